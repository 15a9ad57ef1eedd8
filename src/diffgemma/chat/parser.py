"""Streaming parser of a Gemma 4 reply: token ids in, reasoning / content / tool-call events out.

A reply is `[<|channel>thought\\n REASONING <channel|>] (CONTENT | <|tool_call>call:NAME{...}<tool_call|>)*`
ended by a stop token. A tool call that does not parse is a `BadCall`, never content: tool grammar does not
reach the reply's text. Tokens are handled one at a time, so the events do not depend on how the id stream
is chunked; text is decoded incrementally and a multi-byte character is only emitted once complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.chat.toolcall import parse_call


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class BadCall:
    """A `<|tool_call>` block whose body does not parse (`raw`: its text, control tokens spelled)."""

    raw: str


@dataclass(frozen=True)
class End:
    reason: str


Event = Reasoning | Content | ToolCall | BadCall | End


class _IncrementalText:
    """Decodes a growing id list, holding text back while it ends in an incomplete UTF-8 sequence."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the text already returned

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._ids, self._prefix, self._read = [], 0, 0
        return after[len(before) :]


class StreamParser:
    """Feed reply token ids in any chunking; get `Reasoning`, `Content`, `ToolCall` and `End` events."""

    def __init__(self, tokenizer: ChatTokenizer, thinking_open: bool = False) -> None:
        self._tok = tokenizer
        self._stop = tokenizer.stop_ids
        self._special = tokenizer.special_ids
        self._channel_open = tokenizer.token_to_id("<|channel>")
        self._channel_close = tokenizer.token_to_id("<channel|>")
        self._call_open = tokenizer.token_to_id("<|tool_call>")
        self._call_close = tokenizer.token_to_id("<tool_call|>")
        self._quote = tokenizer.token_to_id('<|"|>')
        self._tool_response = tokenizer.token_to_id("<|tool_response>")
        # thinking_open: the prompt already opened the thought channel, so the reply starts in reasoning.
        self._state = "reasoning" if thinking_open else "content"
        self._text = _IncrementalText(lambda ids: tokenizer.decode(ids, skip_special=True))
        self._held = ""  # trailing newlines of reasoning, dropped if the channel closes right after
        self._header: list[int] = []
        self._call: list[int] = []
        self._saw_call = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, token_ids: Iterable[int]) -> list[Event]:
        events: list[Event] = []
        for token_id in token_ids:
            if self._done:
                break
            self._step(int(token_id), events)
        return events

    def finish(self, reason: str) -> list[Event]:
        """End of generation (e.g. "length"); a no-op if a stop token already ended the reply."""
        if self._done:
            return []
        events: list[Event] = []
        self._close_segment(events)
        self._done = True
        events.append(End(reason))
        return events

    # internals
    def _step(self, t: int, events: list[Event]) -> None:
        if self._state == "call":
            self._step_call(t, events)
        elif t in self._stop:
            self._close_segment(events)
            self._done = True
            ends_for_tool = self._saw_call or t == self._tool_response
            events.append(End("tool_calls" if ends_for_tool else "stop"))
        elif t == self._call_open:
            self._close_segment(events)
            self._state = "call"
        elif t == self._channel_open:
            self._close_segment(events)
            self._state = "header"
        elif t == self._channel_close:
            if self._state in ("header", "reasoning"):
                self._close_segment(events)
            self._state = "content"
        elif t in self._special:
            return  # control tokens never leak into text
        elif self._state == "header":
            self._step_header(t, events)
        else:
            self._emit(self._text.push(t), events)

    def _step_header(self, t: int, events: list[Event]) -> None:
        # `<|channel>NAME\n`: the channel name ends at the first newline; any text after it is reasoning.
        self._header.append(t)
        header = self._tok.decode(self._header, skip_special=True)
        if "\n" in header:
            self._header = []
            self._state = "reasoning"
            self._emit(header.split("\n", 1)[1], events)

    def _step_call(self, t: int, events: list[Event]) -> None:
        if t == self._call_close:
            self._close_call(events)
            self._state = "content"
        elif t in self._stop:
            self._close_call(events)
            self._state = "content"
            self._step(t, events)
        elif t in self._special and t != self._quote:
            return
        else:
            self._call.append(t)

    def _close_call(self, events: list[Event]) -> None:
        raw = self._tok.decode(self._call, skip_special=False)
        self._call = []
        try:
            name, arguments = parse_call(raw)
        except ValueError:
            events.append(BadCall(raw))
            return
        self._saw_call = True
        events.append(ToolCall(name, arguments, raw))

    def _emit(self, text: str, events: list[Event]) -> None:
        if self._state == "reasoning":
            text = self._held + text
            kept = text.rstrip("\n")
            self._held = text[len(kept) :]
            if kept:
                events.append(Reasoning(kept))
        elif text:
            events.append(Content(text))

    def _close_segment(self, events: list[Event]) -> None:
        if self._state == "call":
            self._close_call(events)
        elif self._state == "header":
            self._header = []
        else:
            self._emit(self._text.flush(), events)
        self._held = ""
        self._state = "content"


def coalesce(events: Sequence[Event]) -> list[Event]:
    """Merge runs of adjacent `Reasoning` or `Content` events (e.g. before sending a streaming chunk)."""
    out: list[Event] = []
    for event in events:
        if out and type(event) is type(out[-1]) and isinstance(event, Reasoning | Content):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def parse_reply(
    tokenizer: ChatTokenizer, ids: Sequence[int], thinking_open: bool = False
) -> tuple[str, str, list[ToolCall]]:
    """Parse a whole reply into (content text, reasoning text, tool calls)."""
    parser = StreamParser(tokenizer, thinking_open=thinking_open)
    events = parser.feed(ids) + parser.finish("stop")
    text = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    return text, reasoning, [e for e in events if isinstance(e, ToolCall)]
