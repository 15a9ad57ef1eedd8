"""A conversation's token log mirrored by its KV cache: `sync` keeps the longest common prefix with a prompt (the
pipeline prefills the rest, under the engine's one prefill rule)."""

from __future__ import annotations

from diffgemma.engine.engine import EngineCore
from diffgemma.model.kv_cache import REWIND_SLACK, ring_slots


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Conversation:
    """A KV cache and the tokens it holds (`log`, kept by the prefill: len(log) == kv.length)."""

    def __init__(self, engine: EngineCore, max_tokens: int | None = None, rewind_slack: int = REWIND_SLACK):
        self.engine = engine
        max_tokens = max_tokens or engine.max_tokens
        self.kv = engine.runner.new_cache(
            max_tokens, ring_size=ring_slots(engine.config, max_tokens, rewind_slack)
        )

    @property
    def log(self) -> list[int]:
        return self.kv.tokens

    @property
    def max_tokens(self) -> int:
        return self.kv.max_tokens

    def reset(self) -> None:
        self.kv.reset()

    def sync(self, ids: list[int]) -> int:
        """Cut the cache back to its longest common prefix with `ids`; returns how many tokens are reused.
        When the sliding-window rings no longer hold that point, start over (an explicit re-prefill)."""
        n = common_prefix(self.log, ids)
        if n < len(self.log):
            if self.kv.can_truncate(n):
                self.engine.runner.rewind(self.kv, n)
            else:
                self.kv.reset()
                n = 0
        return n
