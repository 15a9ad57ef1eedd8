"""OpenAI response bodies: chat.completion, text_completion and their server-sent-event chunks.

Log probabilities (when a request asks) cover the tokens of the reply's text (`jobs.listed_logprobs`): a completion's
`text`, a chat reply's content, reasoning and tool calls (with the grammar tokens that frame them), never pad, filler
or a token after a stop string; each from the committing denoise step's logits at temperature 1. A streamed reply
carries them all in its final chunk, as its tokens commit in blocks.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.engine.generate import TokenLogprob
from diffgemma.server.events import Delta, Done


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: the standard chunks are unnamed; diffgemma's extensions name theirs."""
    head = f"event: {event}\n" if event else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def _call(call: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in call.items() if k != "index"}


def _piece(tok: ChatTokenizer | None, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else str(token_id)


def _entry(tok: ChatTokenizer | None, token_id: int, logprob: float) -> dict[str, Any]:
    piece = _piece(tok, token_id)
    raw = tok.token_bytes(token_id) if tok is not None else piece.encode()
    return {"token": piece, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tok: ChatTokenizer | None, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if logprobs is None:
        return None
    return {
        "content": [
            {**_entry(tok, t.token_id, t.logprob), "top_logprobs": [_entry(tok, i, p) for i, p in t.top]}
            for t in logprobs
        ]
    }


def text_logprobs(
    tok: ChatTokenizer | None, logprobs: list[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs and text_offset (characters into
    the choice's text, where `offset` is the echoed prompt's length)."""
    if logprobs is None:
        return None
    offsets = []
    for t in logprobs:
        offsets.append(offset)
        offset += len(tok.decode([t.token_id], skip_special=True)) if tok is not None else 0
    return {
        "tokens": [_piece(tok, t.token_id) for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{_piece(tok, i): p for i, p in t.top} for t in logprobs],
        "text_offset": offsets,
    }


def chat_completion(
    rid: str, model: str, deltas: list[Delta], done: Done, tok: ChatTokenizer | None = None
) -> dict[str, Any]:
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls = [_call(d.call) for d in deltas if d.kind == "tool_call" and d.call is not None]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
        "reasoning_content": reasoning or None,
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": done.finish_reason,
                "logprobs": chat_logprobs(tok, done.logprobs),
            }
        ],
        "usage": done.usage(),
    }


def text_completion(
    rid: str, model: str, prefix: str, deltas: list[Delta], done: Done, tok: ChatTokenizer | None = None
) -> dict[str, Any]:
    text = prefix + "".join(d.text for d in deltas if d.kind == "content")
    logprobs = text_logprobs(tok, done.logprobs, len(prefix))
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": done.finish_reason, "logprobs": logprobs}],
        "usage": done.usage(),
    }


class ChunkWriter:
    """The SSE chunks of one streamed reply ("chat" or "completion")."""

    def __init__(
        self, kind: str, rid: str, model: str, include_usage: bool, tok: ChatTokenizer | None = None
    ) -> None:
        self.kind = kind
        self.tok = tok
        self.rid = rid
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
        }
        if self.include_usage:
            obj["usage"] = usage
        return sse(obj)

    def _choice(
        self, delta: dict[str, Any] | str, finish: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        if self.kind == "chat":
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"index": 0, "text": delta, "finish_reason": finish, "logprobs": logprobs}

    def role(self) -> str:
        return self._chunk(self._choice({"role": "assistant", "content": ""}))

    def delta(self, d: Delta) -> str:
        if self.kind != "chat":
            return self._chunk(self._choice(d.text))
        if d.kind == "tool_call" and d.call is not None:
            return self._chunk(self._choice({"tool_calls": [d.call]}))
        key = "reasoning_content" if d.kind == "reasoning" else "content"
        return self._chunk(self._choice({key: d.text}))

    def finish(self, done: Done) -> str:
        if self.kind == "chat":
            choice = self._choice({}, done.finish_reason, chat_logprobs(self.tok, done.logprobs))
        else:
            choice = self._choice("", done.finish_reason, text_logprobs(self.tok, done.logprobs))
        out = self._chunk(choice)
        if self.include_usage:
            out += self._chunk(None, done.usage())
        return out
