"""The pipeline's ops (what a client asks) and events (what the worker answers), as dataclasses that serialize to
one JSON object each. Ops carry token ids, never text: templates and parsing stay with the client.

A KV position is a `KvId` [epoch, pos] of the active conversation: an op that cuts or rewrites the cached log bumps
the epoch, and a KvId taken before the cut names a position that may no longer hold what it did (`Pipeline`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KvId = tuple[int, int]  # (epoch, pos)


class Message:
    """An op or an event: `to_json` / `from_json` by its class name."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object (tuples as lists, as JSON has them)."""
        fields = {f.name: _lists(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"type": type(self).__name__, **fields}


def _lists(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


def _registry(*classes: type[Message]) -> dict[str, type[Message]]:
    return {c.__name__: c for c in classes}


def from_json(d: dict[str, Any], registry: dict[str, type[Message]]) -> Message:
    """The op or event a `to_json` dict describes; ValueError for an unknown type or fields."""
    d = dict(d)
    name = d.pop("type", None)
    cls = registry.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    try:
        msg = cls(**d)
    except TypeError as e:
        raise ValueError(f"bad {name}: {e}") from None
    for f in dataclasses.fields(cls):  # JSON has lists where the dataclasses hold tuples
        if f.name == "kv" or f.name == "to":
            v = getattr(msg, f.name)
            if isinstance(v, list):
                object.__setattr__(msg, f.name, tuple(v))
    return msg


# -- ops ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op(Message):
    pass


@dataclass(frozen=True)
class Route(Op):
    """Pick the conversation to run a request of these ids on (the longest common prefix; a divergent one gets a
    copy of the shared prefix) and activate it."""

    ids: list[int]


@dataclass(frozen=True)
class Activate(Op):
    """Make conversation `conv` the active one (a new, empty one if there is none of that id)."""

    conv: int


@dataclass(frozen=True)
class Extend(Op):
    """Prefill ids after the active log (seed rule 7: a whole prompt into an empty cache in fp32)."""

    ids: list[int]


@dataclass(frozen=True)
class AlignTo(Op):
    """Cut the active log back to its longest common prefix with ids (a fresh start when the sliding-window rings no
    longer hold that point): what is left is a prefix of ids, so an `Extend` of the rest makes the log ids."""

    ids: list[int]


@dataclass(frozen=True)
class Finalize(Op):
    """End a turn: make the active log exactly ids (the canonical render of the finished turn), cutting to the
    common prefix and prefilling the rest; skipped when ids do not fit the context."""

    ids: list[int]


@dataclass(frozen=True)
class Rewind(Op):
    """Cut the active log back to `to`, a KvId of this conversation that still holds (`Mark`)."""

    to: KvId


@dataclass(frozen=True)
class Splice(Op):
    """Replace log[start:end] with `replacement`: a rewind to start and a re-prefill of replacement + the old tail."""

    start: int
    end: int
    replacement: list[int]


@dataclass(frozen=True)
class SyntheticFill(Op):
    """Prefill n pseudo-random ids (the LCG of `seed`, control ids included): long contexts for tests and gates."""

    n: int
    seed: int = 0


@dataclass(frozen=True)
class KvFingerprint(Op):
    """SHA-256 of the active cache's live K/V in position order."""


@dataclass(frozen=True)
class Mark(Op):
    """The KvId of the active log's end, for a later `Rewind`."""


@dataclass(frozen=True)
class BeginTurn(Op):
    """Open a reply after the active log: seed, reply budget, sampler (None: the engine's), logprobs (top k)."""

    seed: int = 42
    max_new_tokens: int | None = None
    sampler: dict[str, Any] | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class ProposeBlock(Op):
    """Denoise the open turn's next canvas; the cache is not written."""


@dataclass(frozen=True)
class CommitBlock(Op):
    """Take the proposal's first kept_len tokens into the reply."""

    kept_len: int


@dataclass(frozen=True)
class DiscardBlock(Op):
    """Drop the proposal and re-roll the block (the next retry's seed, half the canvas)."""


@dataclass(frozen=True)
class EndTurn(Op):
    """Close the open turn (finished or not) and report the reply."""


@dataclass(frozen=True)
class Generate(Op):
    """Extend by ids and generate a reply under the contract's commit policy: BeginTurn, then ProposeBlock and
    CommitBlock / DiscardBlock until the turn ends, then EndTurn, with the same results."""

    ids: list[int]
    seed: int = 42
    max_new_tokens: int | None = None
    sampler: dict[str, Any] | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class Read(Op):
    """Score a seeded canvas after the active log (the question-schema API): `steps` forwards of `canvas`, then at
    each slot the softmax over its label ids, the entropy over the vocabulary, the label mass and whether the argmax
    is a label. Reads the cache, never writes it."""

    canvas: list[int]
    slots: list[int]
    labels: list[list[int]]
    steps: int = 1


@dataclass(frozen=True)
class Ping(Op):
    pass


@dataclass(frozen=True)
class Cancel(Op):
    """Stop the running turn between denoise steps (sent from another thread; the log keeps where it struck in the
    turn's `steps`)."""


@dataclass(frozen=True)
class Shutdown(Op):
    pass


OPS = _registry(
    Route, Activate, Extend, AlignTo, Finalize, Rewind, Splice, SyntheticFill, KvFingerprint, Mark,
    BeginTurn, ProposeBlock, CommitBlock, DiscardBlock, EndTurn, Generate, Read, Ping, Cancel, Shutdown,
)  # fmt: skip


# -- events ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event(Message):
    pass


@dataclass(frozen=True)
class Activated(Event):
    conv: int
    kv: KvId
    shared: int = 0  # Route: the prompt tokens already cached
    route: str = ""  # Route: new, continue, fork, salvage or re-prefill (`Registry.route`)


@dataclass(frozen=True)
class Extended(Event):
    kv: KvId


@dataclass(frozen=True)
class Aligned(Event):
    kv: KvId
    reused: int  # positions kept


@dataclass(frozen=True)
class Finalized(Event):
    kv: KvId
    skipped: bool = False  # the ids did not fit the context: the log is as it was


@dataclass(frozen=True)
class Rewound(Event):
    kv: KvId


@dataclass(frozen=True)
class Fingerprint(Event):
    sha256: str
    kv: KvId


@dataclass(frozen=True)
class Marked(Event):
    kv: KvId


@dataclass(frozen=True)
class TurnBegun(Event):
    kv: KvId


@dataclass(frozen=True)
class Proposed(Event):
    block: int
    retry: int
    tokens: list[int]
    steps: int
    stop_at: int | None


@dataclass(frozen=True)
class Cancelled(Event):
    """ProposeBlock stopped by a cancel after `cancel_after` denoise steps; the turn is over (EndTurn reports it)."""

    cancel_after: int


@dataclass(frozen=True)
class Committed(Event):
    block: int
    ids: list[int]
    done: bool


@dataclass(frozen=True)
class Discarded(Event):
    block: int
    retry: int  # the next proposal's


@dataclass(frozen=True)
class Replied(Event):
    """A turn's end (EndTurn, Generate): the reply and how it ended; `steps` counts every executed denoise step, so
    a cancelled turn says where the cancel struck. `logprobs`: per token [id, logprob, [[id, logprob], ...]]."""

    token_ids: list[int]
    finish_reason: str
    stop_token: int | None
    steps: int
    blocks: int
    retries: int
    cached_tokens: int
    kv: KvId
    logprobs: list[Any] | None = None
    cancel_after: int | None = None  # cancelled: the denoise steps this op ran before the cancel struck


@dataclass(frozen=True)
class ReadOut(Event):
    probs: list[list[float]]  # a slot's distribution over its labels
    entropy: list[float]
    label_mass: list[float]
    argmax_is_label: list[bool]


@dataclass(frozen=True)
class Pong(Event):
    pass


@dataclass(frozen=True)
class Stopped(Event):
    pass


@dataclass(frozen=True)
class Failed(Event):
    """The op was refused or failed; the state is as the message says (an op never leaves a half-written cache)."""

    message: str
    kind: str = "error"


EVENTS = _registry(
    Activated, Extended, Aligned, Finalized, Rewound, Fingerprint, Marked, TurnBegun, Proposed, Cancelled, Committed,
    Discarded, Replied, ReadOut, Pong, Stopped, Failed,
)  # fmt: skip
