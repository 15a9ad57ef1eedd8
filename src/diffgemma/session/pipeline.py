"""The pipeline's terminal: executes ops on the engine's conversations, one at a time, on the calling thread (the
engine worker's). Stages (`oplog`, `tools`) wrap it with the same interface (`stage.Stage`).

Lineage: each conversation counts epochs. An op that cuts its log (a rewind, a realignment, a splice, a reset, an
eviction) records the cut and starts a new epoch; a KvId (e, p) still names the same content iff p is within the
log and no cut since epoch e went below p. A rewind to any other KvId is refused (`Failed`), never guessed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from diffgemma.config import SamplerConfig
from diffgemma.engine.batch import Request
from diffgemma.engine.engine import ContextOverflow, EngineCore
from diffgemma.engine.generate import (
    CancelToken,
    GenerateOutput,
    StepInfo,
    TokenLogprob,
    Turn,
    drive,
    prefill,
)
from diffgemma.engine.rng import Rng
from diffgemma.session import ops as O
from diffgemma.session.conversation import Conversation, common_prefix
from diffgemma.session.registry import Registry
from diffgemma.session.stage import Emit, Ended, OnStep, Stage

# Failed.kind of an op refused for the size of what it asked (ContextOverflow): the request's doing. Any other kind is
# the caller's use of the ops (or the pipeline's own state) going wrong, which a server must not blame on its client.
CONTEXT = "context"


def failed(e: Exception) -> O.Failed:
    """The `Failed` event of an op that raised `e`: its kind says whether the request's size caused it."""
    return O.Failed(str(e), CONTEXT if isinstance(e, ContextOverflow) else "error")


def failure(event: O.Failed) -> ValueError:
    """The exception a `Failed` event stands for on the caller's side (`failed` backwards)."""
    return ContextOverflow(event.message) if event.kind == CONTEXT else ValueError(event.message)


@dataclasses.dataclass
class Lineage:
    """A conversation's id, epoch and the cut that ended each earlier epoch."""

    conv: int
    epoch: int = 0
    cuts: list[int] = dataclasses.field(default_factory=list)

    def cut(self, pos: int) -> None:
        self.cuts.append(pos)
        self.epoch += 1

    def holds(self, kv: O.KvId, length: int) -> bool:
        e, p = kv
        return 0 <= e <= self.epoch and 0 <= p <= length and all(p <= c for c in self.cuts[e:])


class CountingCancel(CancelToken):
    """The caller's cancel (and the pipeline's own) seen through one token that remembers how many denoise steps
    had run when it was first seen set: where the cancel struck, for the log and its replay."""

    def __init__(self, *tokens: CancelToken | None) -> None:
        super().__init__()
        self.tokens = [t for t in tokens if t is not None]
        self.steps = 0
        self.struck_at: int | None = None

    def counting(self, on_step: Callable[[StepInfo], None] | None) -> Callable[[StepInfo], None]:
        """An on_step that counts the steps for this token, then calls on_step."""

        def step(info: StepInfo) -> None:
            self.steps += 1
            if on_step is not None:
                on_step(info)

        return step

    @property
    def cancelled(self) -> bool:
        if self.struck_at is None and (self._event.is_set() or any(t.cancelled for t in self.tokens)):
            self.struck_at = self.steps
        return self.struck_at is not None


class Pipeline(Stage):
    """Conversations (a `Registry`: routing by longest common prefix, forks, eviction) and the open turn."""

    def __init__(self, engine: EngineCore, ctx: int | None = None, max_conversations: int = 4) -> None:
        self._engine = engine
        self._registry = Registry(engine, ctx or engine.max_tokens, max_conversations)
        self.lineage: dict[int, Lineage] = {}  # id(Conversation) -> its lineage
        self._active: Conversation | None = None
        self.turn: Turn | None = None
        self._cancel = CancelToken()
        # the last Generate's output with its timings, which the events leave out (they must replay identically)
        self._last_output: GenerateOutput | None = None
        self._flight: dict[
            int, tuple[Conversation, Emit]
        ] = {}  # begin_generate's requests: their conversation
        self._handlers: dict[type[O.Op], Callable[..., None]] = {
            O.Route: self._route,
            O.Activate: self._activate,
            O.Extend: self._extend,
            O.AlignTo: self._align,
            O.Finalize: self._finalize,
            O.Rewind: self._rewind,
            O.Splice: self._splice,
            O.SyntheticFill: self._fill,
            O.KvFingerprint: self._fingerprint,
            O.Mark: self._mark,
            O.BeginTurn: self._begin_turn,
            O.ProposeBlock: self._propose,
            O.CommitBlock: self._commit,
            O.DiscardBlock: self._discard,
            O.EndTurn: self._end_turn,
            O.Generate: self._generate,
            O.Read: self._read,
            O.Ping: lambda op, emit, **_: emit(O.Pong()),
            O.Cancel: lambda op, emit, **_: None,  # nothing runs beside it: clients call cancel() instead
            O.Shutdown: lambda op, emit, **_: emit(O.Stopped()),
        }

    @property
    def engine(self) -> EngineCore:
        return self._engine

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def active(self) -> Conversation | None:
        return self._active

    @property
    def last_output(self) -> GenerateOutput | None:
        return self._last_output

    def cancel(self) -> None:
        """Stop the running op between denoise steps (any thread)."""
        self._cancel.cancel()

    def close(self) -> None:
        """Nothing to release: the conversations live as long as the engine."""

    def run(
        self,
        op: O.Op,
        emit: Emit,
        on_step: Callable[[StepInfo], None] | None = None,
        cancel: CancelToken | None = None,
    ) -> None:
        """Execute `op`, emitting its events in order. A refused or failed op emits `Failed` and leaves every cache
        whole (a failed prefill empties its conversation, as a cut); errors other than the user's propagate."""
        self._cancel = CancelToken()
        token = CountingCancel(cancel, self._cancel)
        step = token.counting(on_step)
        for conv in self.registry.conversations:
            conv.kv.take_cut()  # a cut made outside the pipeline is no op's
        try:
            self._handlers[type(op)](op, emit, on_step=step, cancel=token)
        except (ValueError, RuntimeError) as e:
            emit(failed(e))
        finally:
            for conv in self.registry.conversations:
                self._lineage(conv)

    # -- lineage ----------------------------------------------------------------------------------------------

    def _lineage(self, conv: Conversation) -> Lineage:
        """conv's lineage, with the cuts its cache made since the last look."""
        if id(conv) not in self.lineage:
            self.lineage[id(conv)] = Lineage(len(self.lineage))
        lineage = self.lineage[id(conv)]
        cut = conv.kv.take_cut()
        if cut is not None:
            lineage.cut(cut)
        return lineage

    def _conv(self) -> Conversation:
        if self.active is None:
            raise ValueError("no active conversation: send Activate or Route first")
        return self.active

    def kv_id(self, conv: Conversation | None = None) -> O.KvId:
        conv = conv or self._conv()
        return (self._lineage(conv).epoch, conv.kv.length)

    # -- conversations ----------------------------------------------------------------------------------------

    def _route(self, op: O.Route, emit: Emit, **_: Any) -> None:
        self._active = self.registry.route(list(op.ids))
        shared = common_prefix(self.active.log, list(op.ids))
        emit(O.Activated(self._lineage(self.active).conv, self.kv_id(), shared, self.registry.decision))

    def _activate(self, op: O.Activate, emit: Emit, **_: Any) -> None:
        for conv in self.registry.conversations:
            if self._lineage(conv).conv == op.conv:
                self._active = self.registry.touch(conv)
                break
        else:
            if op.conv != len(self.lineage):
                raise ValueError(
                    f"no conversation {op.conv}: a new one takes the next id, {len(self.lineage)}"
                )
            self._active = self.registry.touch(self.registry.blank(keep=self.active))
            self._lineage(self.active)
        emit(O.Activated(self._lineage(self.active).conv, self.kv_id()))

    # -- the active log ---------------------------------------------------------------------------------------

    def _prefill(self, ids: list[int]) -> None:
        """Extend the active cache by ids under the one prefill precision rule (`engine.generate.prefill`: a whole
        short prompt into an empty cache in fp32, every extension in the model's dtype); a failure empties it
        (never a half-written cache)."""
        conv = self._conv()
        if conv.kv.length + len(ids) > conv.max_tokens - 1:
            raise ContextOverflow(
                f"{len(ids)} tokens do not fit the context ({conv.kv.length}/{conv.max_tokens} used)"
            )
        try:
            prefill(self.engine.runner, ids, conv.kv, self.engine.sampler)
        except BaseException:
            conv.reset()
            raise

    def _extend(self, op: O.Extend, emit: Emit, **_: Any) -> None:
        self._prefill(list(op.ids))
        emit(O.Extended(self.kv_id()))

    def _align(self, op: O.AlignTo, emit: Emit, **_: Any) -> None:
        reused = self._conv().sync(list(op.ids))
        emit(O.Aligned(self.kv_id(), reused))

    def _finalize(self, op: O.Finalize, emit: Emit, **_: Any) -> None:
        conv, ids = self._conv(), list(op.ids)
        if len(ids) + 1 >= conv.max_tokens:
            emit(O.Finalized(self.kv_id(), skipped=True))
            return
        n = conv.sync(ids)
        if ids[n:]:
            self._prefill(ids[n:])
        emit(O.Finalized(self.kv_id()))

    def _rewind(self, op: O.Rewind, emit: Emit, **_: Any) -> None:
        conv = self._conv()
        if not self._lineage(conv).holds(op.to, conv.kv.length):
            raise ValueError(
                f"stale KV position {list(op.to)}: conversation {self._lineage(conv).conv} is at "
                f"{list(self.kv_id())} and no longer holds what that position named"
            )
        pos = op.to[1]
        if not conv.kv.can_truncate(pos):
            raise ValueError(f"cannot rewind to {pos}: the sliding-window rings no longer hold it")
        if pos < conv.kv.length:
            self.engine.runner.rewind(conv.kv, pos)
        emit(O.Rewound(self.kv_id()))

    def _splice(self, op: O.Splice, emit: Emit, **_: Any) -> None:
        conv = self._conv()
        log = list(conv.log)
        if not 0 <= op.start <= op.end <= len(log):
            raise ValueError(f"splice {op.start}:{op.end} outside the log of {len(log)} tokens")
        if not conv.kv.can_truncate(op.start):
            raise ValueError(f"cannot splice at {op.start}: the sliding-window rings no longer hold it")
        tail = list(op.replacement) + log[op.end :]
        if op.start + len(tail) > conv.max_tokens - 1:
            raise ContextOverflow(
                f"the spliced log of {op.start + len(tail)} tokens does not fit the context"
            )
        if op.start < conv.kv.length:
            self.engine.runner.rewind(conv.kv, op.start)
        if tail:
            self._prefill(tail)
        emit(O.Extended(self.kv_id()))

    def _fill(self, op: O.SyntheticFill, emit: Emit, **_: Any) -> None:
        if op.n < 0:
            raise ValueError(f"SyntheticFill of {op.n} tokens")
        ids = Rng(op.seed).tokens(op.n, self.engine.config.vocab_size).tolist()
        self._prefill(ids)
        emit(O.Extended(self.kv_id()))

    def _fingerprint(self, op: O.KvFingerprint, emit: Emit, **_: Any) -> None:
        emit(O.Fingerprint(self._conv().kv.fingerprint(), self.kv_id()))

    def _mark(self, op: O.Mark, emit: Emit, **_: Any) -> None:
        emit(O.Marked(self.kv_id()))

    @torch.no_grad()
    def _read(self, op: O.Read, emit: Emit, **_: Any) -> None:
        kv = self._conv().kv
        if kv.length == 0:
            raise ValueError("Read needs a prompt in the cache: Extend first")
        if len(op.slots) != len(op.labels) or not all(0 <= s < len(op.canvas) for s in op.slots):
            raise ValueError("Read: one label list a slot, each slot inside the canvas")
        if kv.length + len(op.canvas) > kv.max_tokens:
            raise ContextOverflow(
                f"a canvas of {len(op.canvas)} does not fit after {kv.length} of {kv.max_tokens} tokens"
            )
        runner, canvas = self.engine.runner, torch.tensor([list(op.canvas)], dtype=torch.long)
        logits = runner.denoise(canvas, kv, sc_seed=self.engine.sampler.first_step_sc_seed)
        for _ in range(op.steps - 1):  # the next forward conditions on this one's probabilities
            logits = runner.denoise(
                canvas, kv, sc_probs=torch.softmax(logits[0].float(), dim=-1), sc_exact=True
            )
        rows = logits[0, list(op.slots)].float()
        logp = torch.log_softmax(rows, dim=-1)
        p = logp.exp()
        entropy = (-(p * logp).sum(-1)).tolist()
        argmax = rows.argmax(-1).tolist()
        probs, mass, is_label = [], [], []
        for i, ids in enumerate(op.labels):
            probs.append(torch.softmax(rows[i, list(ids)], dim=-1).tolist())
            mass.append(float(p[i, list(ids)].sum()))
            is_label.append(argmax[i] in ids)
        emit(O.ReadOut(probs, entropy, mass, is_label))

    # -- turns ------------------------------------------------------------------------------------------------

    def sampler(self, fields: dict[str, Any] | None) -> SamplerConfig:
        """The engine's sampler config, or the one these fields (`sampler_fields`) describe."""
        if fields is None:
            return self.engine.sampler
        fields = dict(fields)
        fields["stop_token_ids"] = tuple(fields.get("stop_token_ids", self.engine.sampler.stop_token_ids))
        return SamplerConfig(**fields).validated()

    def _open(
        self, ids: list[int], seed: int, max_new: int | None, fields: dict | None, lp: int | None
    ) -> Turn:
        if self.turn is not None and not self.turn.done:
            raise ValueError("a turn is already open: EndTurn first")
        self.turn = self.engine.turn(ids, self._conv().kv, self.sampler(fields), seed, max_new, lp)
        return self.turn

    def _begin_turn(self, op: O.BeginTurn, emit: Emit, **_: Any) -> None:
        self._open([], op.seed, op.max_new_tokens, op.sampler, op.logprobs)
        emit(O.TurnBegun(self.kv_id()))

    def _open_turn(self) -> Turn:
        if self.turn is None:
            raise ValueError("no turn is open: BeginTurn first")
        return self.turn

    def _propose(self, op: O.ProposeBlock, emit: Emit, on_step=None, cancel=None) -> None:
        turn = self._open_turn()
        prop = turn.propose(on_step, cancel)
        if prop is None:
            emit(O.Cancelled(cancel.struck_at or 0))
            return
        emit(O.Proposed(prop.block, prop.retry, prop.tokens, prop.steps, prop.stop_at))

    def _commit(self, op: O.CommitBlock, emit: Emit, **_: Any) -> None:
        turn = self._open_turn()
        kept = turn.commit(op.kept_len)
        emit(O.Committed(turn.out.blocks - 1, kept, turn.done))

    def _discard(self, op: O.DiscardBlock, emit: Emit, **_: Any) -> None:
        turn = self._open_turn()
        turn.discard()
        emit(O.Discarded(turn.block, turn.retry))

    def _end_turn(self, op: O.EndTurn, emit: Emit, cancel=None, **_: Any) -> None:
        turn = self._open_turn()
        self.turn = None
        emit(self._replied(turn, None))

    def _replied(self, turn: Turn, cancel_after: int | None, conv: Conversation | None = None) -> O.Replied:
        out = turn.out
        lps = [_logprob_json(t) for t in out.logprobs] if turn.logprobs is not None else None
        return O.Replied(
            out.token_ids, out.finish_reason, out.stop_token, out.steps, out.blocks, out.retries,
            out.cached_tokens, self.kv_id(conv), lps, cancel_after,
        )  # fmt: skip

    # -- a Generate in flight beside others (the batching worker) ---------------------------------------------

    def begin_generate(
        self,
        op: O.Generate,
        emit: Emit,
        on_step: Callable[[StepInfo], None] | None = None,
        cancel: CancelToken | None = None,
    ) -> Request | None:
        """Open `op`'s turn on the active conversation (its prompt prefilled) as a scheduler `Request` whose commits
        emit `Committed`; its conversation is busy (routing passes it by) until `end_generate`. None, with `Failed`
        emitted, when the op is refused. The events, and the tokens, are those `run(op)` gives."""
        conv = self._conv()
        if self.turn is not None and not self.turn.done:
            emit(O.Failed("a turn is already open: EndTurn first"))
            return None
        token = CountingCancel(cancel, self._cancel)
        step = token.counting(on_step)
        try:
            turn = self.engine.turn(
                list(op.ids),
                conv.kv,
                self.sampler(op.sampler),
                op.seed,
                op.max_new_tokens,
                op.logprobs,
                prefill_now=False,  # the scheduler prefills it, a budget a step beside the running canvases
            )
        except ValueError as e:  # refused before the cache was written
            emit(failed(e))
            return None
        except BaseException:
            conv.reset()
            raise
        self.registry.busy.add(id(conv))
        request = Request(
            turn, step, lambda t, kept: emit(O.Committed(t.out.blocks - 1, kept, t.done)), token
        )
        self._flight[id(request)] = (conv, emit)
        return request

    def abort_generate(self, request: Request) -> None:
        """Drop a begun Generate that cannot end (its forward failed): its conversation emptied (no half-written
        cache) and freed."""
        conv, _ = self._flight.pop(id(request))
        self.registry.busy.discard(id(conv))
        conv.reset()

    def conv_id(self, conv: Conversation) -> int:
        """The id `Activate` takes for conv."""
        return self._lineage(conv).conv

    def end_generate(self, request: Request) -> Ended:
        """Close a finished (or failed) `begin_generate`: emit its `Replied`, free its conversation."""
        conv, emit = self._flight.pop(id(request))
        self.registry.busy.discard(id(conv))
        turn = request.turn
        if not turn.done:  # the worker gave up on it (an error beside it): the cache holds no half block
            conv.reset()
            raise RuntimeError("end_generate of a turn that has not ended")
        struck = request.cancel.struck_at if turn.out.finish_reason == "cancelled" else None
        self._last_output = turn.out
        emit(self._replied(turn, struck, conv))
        return turn.out

    def _generate(self, op: O.Generate, emit: Emit, on_step=None, cancel=None) -> None:
        run_generate(self, op, emit, on_step, cancel)


def run_generate(
    stage: Stage, op: O.Generate, emit: Emit, on_step: OnStep | None, cancel: CancelToken | None
) -> None:
    """A Generate run at once on `stage`: `begin_generate`, its turn driven here to its end, `end_generate`, and the
    same for each request `end_generate` answers with (a tool stage's next attempt), as the batching worker does."""
    request = stage.begin_generate(op, emit, on_step, cancel)
    while request is not None:
        try:
            drive(request.turn, request.on_step, request.cancel, request.on_commit)
        except BaseException:
            stage.abort_generate(request)  # never leave a half-written cache behind
            raise
        ended = stage.end_generate(request)
        request = ended if isinstance(ended, Request) else None


def call(
    pipeline: Stage, op: O.Op, on_event: Callable[[O.Event], None] | None = None, **kwargs: Any
) -> list[O.Event]:
    """Run op on a pipeline (or a stage around one) and return its events; a `Failed` one raises ValueError with
    its message (`ContextOverflow` for a context refusal), after `on_event` has seen the others."""
    events: list[O.Event] = []
    pipeline.run(op, collector(events, on_event), **kwargs)
    if events and isinstance(events[-1], O.Failed):
        raise failure(events[-1])
    return events


def collector(events: list[O.Event], on_event: Callable[[O.Event], None] | None) -> Emit:
    """The emit that appends to `events` and shows `on_event` every event but a `Failed`."""

    def emit(event: O.Event) -> None:
        events.append(event)
        if on_event is not None and not isinstance(event, O.Failed):
            on_event(event)

    return emit


def _logprob_json(t: TokenLogprob) -> list[Any]:
    return [t.token_id, t.logprob, [list(p) for p in t.top]]


def sampler_fields(cfg: SamplerConfig) -> dict[str, Any]:
    """A sampler config as the JSON fields of BeginTurn / Generate."""
    d = dataclasses.asdict(cfg)
    d["stop_token_ids"] = list(cfg.stop_token_ids)
    return d
