"""OpenAI response bodies: chat.completion, text_completion and their server-sent-event chunks."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from diffgemma.server.jobs import Delta, Done


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def _call(call: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in call.items() if k != "index"}


def chat_completion(rid: str, model: str, deltas: list[Delta], done: Done) -> dict[str, Any]:
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
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}],
        "usage": done.usage(),
    }


def text_completion(rid: str, model: str, prefix: str, deltas: list[Delta], done: Done) -> dict[str, Any]:
    text = prefix + "".join(d.text for d in deltas if d.kind == "content")
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": done.finish_reason, "logprobs": None}],
        "usage": done.usage(),
    }


class ChunkWriter:
    """The SSE chunks of one streamed reply ("chat" or "completion")."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool) -> None:
        self.kind = kind
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

    def _choice(self, delta: dict[str, Any] | str, finish: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}

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
        out = self._chunk(self._choice({} if self.kind == "chat" else "", done.finish_reason))
        if self.include_usage:
            out += self._chunk(None, done.usage())
        return out
