"""What a job sends its request's `Channel`: `Delta`s as blocks commit, `CanvasEvent`s as steps denoise, and one
`Done` or `JobFailed` at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.engine.generate import StepInfo, TokenLogprob
from diffgemma.server.errors import APIError


@dataclass
class Delta:
    kind: str  # "reasoning", "content" or "tool_call"
    text: str = ""
    call: dict[str, Any] | None = None


@dataclass
class CanvasEvent:
    """One denoise step's canvas, streamed as a `canvas` event (`stream_options.canvas`): each row's most likely
    token's text, whether the step accepted it (else it was renoised), and its entropy in nats."""

    block: int
    step: int
    temperature: float
    tokens: list[str]
    accepted: list[bool]
    entropy: list[float]

    def body(self) -> dict[str, Any]:
        return {
            "object": "diffgemma.canvas",
            "block": self.block,
            "step": self.step,
            "temperature": round(self.temperature, 4),
            "tokens": self.tokens,
            "accepted": self.accepted,
            "entropy": [round(h, 3) for h in self.entropy],
        }


class CanvasFrames:
    """A Generate's `on_step`: each step's `CanvasEvent` to `emit`, at most one every `interval_ms` (the step's tensors
    are read to the host only for the steps sent)."""

    def __init__(self, tok: ChatTokenizer, interval_ms: int, emit: Callable[[Any], None]) -> None:
        self.tok, self.interval, self.emit = tok, interval_ms / 1000, emit
        self.last = -float("inf")

    def __call__(self, info: StepInfo) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval:
            return
        self.last = now
        ids = info.argmax.tolist()
        pieces = [self.tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
        entropy = info.entropy.tolist()
        self.emit(
            CanvasEvent(info.block, info.step, info.temperature, pieces, info.accepted.tolist(), entropy)
        )


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    steps: int = 0
    attempts: int = 1
    logprobs: list[TokenLogprob] | None = None  # each generated token's, when the request asked

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class JobFailed:
    error: APIError
