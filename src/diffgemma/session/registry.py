"""Conversation routing: each request runs on the cached token log that shares its longest prefix (the token
pipeline's conversation table, `Route`).

Only the engine worker thread touches a registry. A conversation's KV holds exactly its token log, and the
KV of a prefix depends only on that prefix, so reusing the longest common prefix never lets one
conversation's tokens into another's answer.
"""

from __future__ import annotations

import logging
import time

from diffgemma.engine.engine import EngineCore
from diffgemma.model.kv_cache import KVCache
from diffgemma.session import Conversation, common_prefix

log = logging.getLogger("diffgemma.server")

# Below this many shared tokens a divergent request starts a fresh conversation rather than copying KV.
MIN_FORK_TOKENS = 16
# The seed's salvage rule with every slot taken: a divergent request that shares at least this long a prefix ...
SALVAGE_MIN_PREFIX = 256
# ... with at most this many cached tokens after it cuts that tail in place (anything deeper is a re-prefill)
SALVAGE_MAX_TAIL = 512
# A served reply is rewound and re-rendered after each turn; keep replies up to this long rewindable
# (0.2 MB per slot on the real model) instead of re-prefilling the whole conversation.
SERVE_REWIND_SLACK = 4096


class Registry:
    def __init__(self, engine: EngineCore, ctx: int, max_conversations: int = 4) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        self.engine = engine
        self.ctx = ctx
        self.max_conversations = max_conversations
        self.conversations: list[Conversation] = []
        self.decision = ""  # how the last `route` chose: new, continue, fork, salvage or re-prefill
        # id()s of conversations a turn is running on (the batching worker): routing passes them by
        self.busy: set[int] = set()
        self._used: dict[int, float] = {}  # id(conversation) -> last use

    def __len__(self) -> int:
        return len(self.conversations)

    def touch(self, conv: Conversation) -> Conversation:
        self._used[id(conv)] = time.monotonic()
        return conv

    def _lru(self) -> Conversation:
        return min(self.conversations, key=lambda c: self._used[id(c)])

    def idle(self) -> list[Conversation]:
        """The conversations no turn is running on."""
        return [c for c in self.conversations if id(c) not in self.busy]

    def victim(self, keep: Conversation | None = None) -> Conversation | None:
        """The least recently used idle conversation other than `keep` (None when there is none)."""
        victims = [c for c in self.idle() if c is not keep]
        return min(victims, key=lambda c: self._used[id(c)]) if victims else None

    def blank(self, keep: Conversation | None = None) -> Conversation:
        """A new conversation, or the least recently used idle one (`keep` only when no other is idle) reset when at
        the bound."""
        if len(self.conversations) < self.max_conversations:
            conv = Conversation(self.engine, self.ctx, rewind_slack=SERVE_REWIND_SLACK)
            self.conversations.append(conv)
            return conv
        conv = self.victim(keep) or (keep if keep is not None and id(keep) not in self.busy else None)
        if conv is None:
            raise RuntimeError(
                "every conversation is busy: the worker admits no more turns than conversations"
            )
        return self._evict(conv)

    def _evict(self, conv: Conversation) -> Conversation:
        log.info("evicting a conversation of %d tokens (least recently used)", len(conv.log))
        conv.reset()
        return conv

    def route(self, ids: list[int]) -> Conversation:
        """The conversation to run `ids` on; `decision` says how it was chosen. A request that extends a log, or
        repeats a prefix of it, continues it. One that diverges from a log gets a copy of the shared prefix while a
        slot is free, so the other branch stays cached for its own client; with every slot taken, a shared prefix of
        SALVAGE_MIN_PREFIX or more whose divergent tail is at most SALVAGE_MAX_TAIL is salvaged in place (the seed's
        rule: the tail is cut, the prefix reused), a shorter one is copied into the least recently used other idle slot
        (when its source is the only idle one, that copy would evict its own source: the source is cut in place, the
        same cache a copy leaves), and anything else is prefilled anew. Every choice but continuing is logged with its
        numbers."""
        best, shared = None, 0
        for conv in sorted(self.idle(), key=lambda c: -self._used[id(c)]):
            n = common_prefix(conv.log, ids)
            if n > shared:
                best, shared = conv, n
        if best is None:
            self.decision = "new"
            return self.touch(self.blank())
        # It extends the log, or repeats a prefix of it (a retried turn, an identical request): its own cache.
        if shared in (len(best.log), len(ids)):
            self.decision = "continue"
            return self.touch(best)
        tail = len(best.log) - shared
        cuttable = best.kv.can_truncate(shared)
        free = len(self.conversations) < self.max_conversations
        salvage = shared >= SALVAGE_MIN_PREFIX and tail <= SALVAGE_MAX_TAIL
        if self.max_conversations == 1:  # nowhere to fork to: cut in place whatever the ring allows
            salvage = shared >= MIN_FORK_TOKENS
        forkable = cuttable and shared >= MIN_FORK_TOKENS and self.max_conversations > 1
        into = None if free else self.victim(keep=best)  # where a fork's copy goes with every slot taken
        why = ""
        if forkable and free:
            self.decision = "fork"
        elif cuttable and salvage:
            self.decision = "salvage"
        elif forkable and into is not None:
            self.decision = "fork"
        elif (
            forkable
        ):  # the other slots all run turns: evicting the source to copy it would leave nothing to copy
            self.decision, why = "salvage", "; the fork's source is the only idle conversation"
        else:
            self.decision = "re-prefill"
        log.info("route: %s (shared prefix %d, divergent cached tail %d%s)", self.decision, shared, tail, why)
        if self.decision == "salvage":
            return self.touch(best)  # the caller's AlignTo cuts the tail
        if self.decision == "re-prefill":
            if self.max_conversations == 1:
                best.reset()
                return self.touch(best)
            return self.touch(self.blank(keep=best))
        if not free and into is None:  # the branches above never fork without a slot for the copy
            raise RuntimeError("route: a fork with no idle slot but its source")
        fork = self.blank() if free else self._evict(into)
        copy_prefix(best.kv, fork.kv, shared)
        self.engine.runner.rewind(fork.kv, shared)  # the copy's last chunk as a prefill of its own tokens
        return self.touch(fork)

    def check(self) -> None:
        """The invariant every conversation keeps (tests call this)."""
        for conv in self.conversations:
            assert len(conv.log) == conv.kv.length, (len(conv.log), conv.kv.length)


def copy_prefix(src: KVCache, dst: KVCache, n: int) -> None:
    """Make `dst` hold the K/V of the first `n` positions of `src` (same geometry; `src.can_truncate(n)`), as
    `KVCache.truncate` leaves them."""
    if src is dst:  # a routing bug (reset first, the copy would find nothing), never the request's fault
        raise RuntimeError("copy_prefix onto its own source")
    for layer in range(len(src.k)):
        if src.cfg.is_sliding(layer):  # a ring: copy it whole, the slots of positions < n are valid
            dst.k[layer].copy_(src.k[layer])
            dst.v[layer].copy_(src.v[layer])
        else:
            dst.k[layer][:, :, :n].copy_(src.k[layer][:, :, :n])
            dst.v[layer][:, :, :n].copy_(src.v[layer][:, :, :n])
    dst.length, dst.oldest = src.length, src.oldest  # oldest: what the copied rings still hold
    dst.tokens = list(src.tokens)
    dst.truncate(n)
