"""Gemma 4 chat format: tokenizer, prompt rendering, tool-call grammar and streaming reply parsing."""

from diffgemma.chat.parser import (
    BadCall,
    Content,
    End,
    Event,
    Reasoning,
    StreamParser,
    ToolCall,
    coalesce,
    parse_reply,
)
from diffgemma.chat.template import render_gemma4
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.chat.toolcall import format_call, format_value, parse_call, parse_value

__all__ = [
    "BadCall",
    "ChatTokenizer",
    "Content",
    "End",
    "Event",
    "Reasoning",
    "StreamParser",
    "ToolCall",
    "coalesce",
    "format_call",
    "format_value",
    "parse_call",
    "parse_reply",
    "parse_value",
    "render_gemma4",
]
