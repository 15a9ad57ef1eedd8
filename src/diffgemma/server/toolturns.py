"""Tool-turn continuation (seed Part III, on by default): with thinking on, a tool-mode prompt seeds the thought
channel open, and a request that is our last tool round's next one (the same messages, our echoed calls, their
results) prompts as that round's raw token log, reasoning intact, plus the rendered results and a reopened thought.
Mid-turn rounds keep the raw log in the cache (a pure extension a round); the round that ends the turn finalizes
thought-free as always, so reasoning never crosses a turn boundary. Without it the model re-planned from scratch
every round: the canonical render drops the reasoning of earlier rounds.

With thinking off there is no reasoning to keep, and the canonical render is what the model reads (unchanged)."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any

from diffgemma.chat.tokenizer import ChatTokenizer

THOUGHT_OPEN = "<|channel>thought\n"


@dataclass(frozen=True)
class ToolRound:
    """A round that ended in tool calls: the request's messages, our calls as the client echoes them, and the raw
    token log the cache holds for it (prompt, reply, the response opener that stopped it)."""

    messages: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    raw: list[int]
    tools: list[dict[str, Any]] | None


def _call_key(call: dict[str, Any]) -> tuple[str, str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    return (str(call.get("id")), str(fn.get("name")), json.dumps(args, sort_keys=True))


class ToolRounds:
    """The last tool rounds (a few, one per cached conversation), matched against new requests; thread-safe (the
    prompt is built off the worker thread, rounds are remembered on it)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._rounds: list[ToolRound] = []
        self._lock = threading.Lock()

    def remember(self, round_: ToolRound) -> None:
        with self._lock:
            self._rounds = [r for r in self._rounds if r.messages != round_.messages][-(self.keep - 1) :]
            self._rounds.append(round_)

    def match(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ToolRound | None:
        """The round `messages` continue: its messages, then an assistant message with exactly its calls, then one
        or more tool results and nothing else."""
        with self._lock:
            rounds = list(self._rounds)
        for r in reversed(rounds):
            n = len(r.messages)
            if len(messages) < n + 2 or messages[:n] != r.messages or tools != r.tools:
                continue
            reply, rest = messages[n], messages[n + 1 :]
            echoed = reply.get("tool_calls") or []
            if reply.get("role") != "assistant" or [_call_key(c) for c in echoed] != [
                _call_key(c) for c in r.calls
            ]:
                continue
            if rest and all(m.get("role") == "tool" for m in rest):
                return r
        return None


def continuation_ids(
    tok: ChatTokenizer, round_: ToolRound, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int] | None:
    """The next round's prompt: the round's raw log, the results as the template renders them after our calls, and a
    reopened thought; None when the template does not render the calls as the round's canonical form ends."""
    n = len(round_.messages) + 1
    calls_turn = tok.encode_chat(messages[:n], tools=tools, add_generation_prompt=False, enable_thinking=True)
    full = tok.encode_chat(messages, tools=tools, add_generation_prompt=True, enable_thinking=True)
    if full[: len(calls_turn)] != calls_turn or calls_turn[-1:] != round_.raw[-1:]:
        return None  # the canonical form ends at the response opener, as the raw log does
    return round_.raw + full[len(calls_turn) :] + tok.encode(THOUGHT_OPEN)
