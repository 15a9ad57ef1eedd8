"""Many turns advanced together, one forward a step for all of their canvases. The `Scheduler` decides and the
runner executes, and they meet only in data (`runner.runner`'s contract): `Scheduler.schedule` plans a round from
the requests' state alone (`StepPlan`s: the prompt chunks a token budget allows, the commits of the blocks that
finished, one forward's canvases each), `ModelRunner.execute` runs a plan and gives back each canvas's logits (a
`ModelOutput`), and `Scheduler.update_from_output` takes what ran: each canvas's sampler step, the blocks that
finished committed (their prefill goes in the next round's plan) or re-rolled, the turns that ended retired. A
request's tokens do not depend on what shares its forward.

Each canvas's decoder input (its embeddings and the SC MLP on its own soft signal: probabilities, the first-step
seed, or none, exact or not) is computed on its own rows, as a lone canvas's is; the layers and the LM head then run
once over every canvas's rows, attention row by row. On the reference kernels (any device) that is the same
arithmetic row for row; on the GPU's fast kernels a GEMM over more rows may sum in another order
(docs/performance.md, "Many canvases per forward")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffgemma.engine.generate import CancelToken, Canvas, StepInfo, Turn, default_commit, prefill_dtype
from diffgemma.engine.sampler import RowStats, row_stats, split_rows
from diffgemma.model.kv_cache import KVCache
from diffgemma.runner.runner import DenoiseInput, ModelOutput, ModelRunner, Prefill, StepPlan, follows

# Prompt tokens a round prefills while other requests denoise (`Scheduler._schedule_prompts`): ~25 ms on the H200 at
# 1k context, about one batched step of 4 canvases (docs/performance.md, "Many canvases per forward").
PREFILL_BUDGET = 1024


@dataclass
class Request:
    """A turn in the scheduler, with its callbacks: `on_step(info)` after each of its denoise steps, `on_commit(turn,
    kept)` after each commit; `cancel` is checked before each of its steps."""

    turn: Turn
    on_step: Callable[[StepInfo], None] | None = None
    on_commit: Callable[[Turn, list[int]], None] | None = None
    cancel: CancelToken | None = None
    canvas: Canvas | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.turn.done

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.cancelled


@dataclass
class SchedulerOutput:
    """One plan of a round and whose each of its items is: `prompts[i]`'s chunk is `plan.prompts[i]`, `commits[i]`'s
    block `plan.commits[i]`, `canvases[i]`'s canvas `plan.canvases[i]`; `cancelled`, the turns it ends."""

    plan: StepPlan = field(default_factory=StepPlan)
    prompts: list[Request] = field(default_factory=list)
    commits: list[Request] = field(default_factory=list)
    canvases: list[Request] = field(default_factory=list)
    cancelled: list[Request] = field(default_factory=list)

    def prompt(self, r: Request, chunk: Prefill) -> None:
        self.plan.prompts.append(chunk)
        self.prompts.append(r)

    def commit(self, r: Request, block: Prefill) -> None:
        self.plan.commits.append(block)
        self.commits.append(r)

    def denoise(self, r: Request) -> None:
        self.plan.canvases.append(DenoiseInput(r.canvas.ids, r.turn.kv, *r.canvas.sc_input()))
        self.canvases.append(r)

    def cached(self, kv: KVCache) -> int:
        """The length of `kv` once this plan's prompt chunks have run."""
        return kv.length + sum(len(p.ids) for p in self.plan.prompts if p.kv is kv)


class Scheduler:
    """Turns advanced together, a round a `step`: each opens a canvas for every turn that needs one (prefilling its
    last commit first), drops cancelled turns, advances every canvas by one step in forwards of at most `max_batch`
    canvases of one length, and commits (or re-rolls) the blocks that finished under the contract's policy
    (`default_commit`). It reaches the runner only through `ModelRunner.execute` (and its dtype, for the sampler's
    buffers)."""

    def __init__(self, runner: ModelRunner, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.runner = runner
        self.max_batch = max_batch
        self.requests: list[Request] = []
        self.forwards: list[int] = []  # canvases a forward, one entry a forward (metrics, tests)

    def submit(self, request: Request) -> Request:
        self.requests.append(request)
        return request

    @property
    def active(self) -> list[Request]:
        return [r for r in self.requests if not r.done]

    def run(self) -> None:
        """Step until every submitted turn is done."""
        while self.active:
            self.step()

    def step(self) -> None:
        """One round: each of its plans run and then applied, in order."""
        for scheduled in self.schedule():
            self.update_from_output(scheduled, self.runner.execute(scheduled.plan))
        self.requests = self.active  # the finished leave

    # -- deciding ---------------------------------------------------------------------------------------------

    def schedule(self) -> list[SchedulerOutput]:
        """The next round, planned from the requests' state: the first plan holds the prompt chunks
        (`_schedule_prompts`), the commits of the turns that open a canvas and the cancelled turns; each plan one
        forward. A chunk or a commit planned is taken from its turn (`Turn.unprefilled`, `Turn.pending`)."""
        first = SchedulerOutput()
        self._schedule_prompts(first)
        opening = [r for r in self.active if r.canvas is None and not r.turn.unprefilled]
        for r in self.active:  # a cancelled turn's prompt is in its cache, as a lone turn's would be
            if r.turn.unprefilled and r.cancelled:
                self._schedule_prompt(first, r)
                opening.append(r)
        # a commit is prefilled before its turn goes on or ends (cancelled), as a lone turn's is
        for r in opening:
            if r.turn.pending:
                first.commit(r, self._prefill(first, r.turn, r.turn.pending))
                r.turn.pending = []
        live = []
        for r in self.active:
            if r.cancelled:
                first.cancelled.append(r)
            elif not r.turn.unprefilled:  # else its prompt goes on in the next round's budget
                if r.canvas is None:
                    r.canvas = r.turn.canvas()
                live.append(r)
        groups: dict[int, list[Request]] = {}
        for r in live:  # forwards of at most max_batch canvases of one length
            groups.setdefault(r.canvas.length, []).append(r)
        forwards = [
            g[i : i + self.max_batch] for g in groups.values() for i in range(0, len(g), self.max_batch)
        ]
        plans = [first]
        for i, group in enumerate(forwards):
            if i:
                plans.append(SchedulerOutput())
            for r in group:
                plans[-1].denoise(r)
        return plans

    def _schedule_prompts(self, first: SchedulerOutput) -> None:
        """Plan the prompts of turns that have not started, first come first: all of them while no canvas is
        denoising, else at most PREFILL_BUDGET tokens this round, so that a long prompt does not stall the running
        requests (chunked prefill)."""
        waiting = [r for r in self.active if r.turn.unprefilled]
        denoising = len(waiting) < len(self.active)
        budget = PREFILL_BUDGET if denoising else None
        for r in waiting:
            if budget is not None and budget <= 0:
                break
            n = self._schedule_prompt(first, r, budget)
            if budget is not None:
                budget -= n

    def _schedule_prompt(self, scheduled: SchedulerOutput, r: Request, budget: int | None = None) -> int:
        """Plan the next `budget` tokens of r's prompt (all of them by default); returns how many. A prompt that
        fits the budget goes in whole, so that seed rule 7 (a whole short prompt in fp32) sees it as a lone turn's."""
        turn = r.turn
        ids = turn.unprefilled if budget is None else turn.unprefilled[:budget]
        if not ids:
            return 0
        scheduled.prompt(r, self._prefill(scheduled, turn, ids))
        turn.unprefilled = turn.unprefilled[len(ids) :]
        return len(ids)

    def _prefill(self, scheduled: SchedulerOutput, turn: Turn, ids: list[int]) -> Prefill:
        """`ids` after `turn`'s cache, in the dtype seed rule 7 gives them there (`prefill_dtype`)."""
        n = len(ids)
        return Prefill(turn.kv, ids, prefill_dtype(self.runner.dtype, n, scheduled.cached(turn.kv), turn.cfg))

    # -- taking what ran --------------------------------------------------------------------------------------

    def update_from_output(self, scheduled: SchedulerOutput, output: ModelOutput) -> None:
        """Take what `scheduled`'s plan gave: each turn's prefill time, the cancelled turns ended, then each canvas's
        sampler step on its logits (one host read for the forward's stop verdicts), its `on_step`, and the blocks
        that finished committed or re-rolled (`_finish_block`)."""
        for r, seconds in zip(scheduled.prompts, output.prompt_seconds, strict=True):
            r.turn.out.prefill_seconds += seconds
        for r, seconds in zip(scheduled.commits, output.commit_seconds, strict=True):
            r.turn.out.prefill_seconds += seconds  # the pass it waited for
        for r in scheduled.cancelled:
            r.turn.propose_from(None)
            r.canvas = None
        if not scheduled.canvases:
            return
        t0 = time.perf_counter()
        infos, stops = [], []
        shared = self._row_passes([r.canvas for r in scheduled.canvases], output.logits)
        for r, logits, stats in zip(scheduled.canvases, output.logits, shared, strict=True):
            cv = r.canvas
            sc_out = None
            if cv.cfg.sc_sparse and stats is None:  # the model's dtype, as a lone canvas's graph buffer is
                sc_out = torch.empty(
                    cv.length, logits.shape[-1], device=logits.device, dtype=self.runner.dtype
                )
            info, stop = cv.advance(logits, sc_out, stats)
            infos.append(info)
            stops.append(stop)
        verdicts = torch.stack(stops).tolist()  # the forward's one host read
        for r, logits, stop in zip(scheduled.canvases, output.logits, verdicts, strict=True):
            r.canvas.settle(stop, logits)
        self.forwards.append(len(scheduled.canvases))
        for r, info in zip(scheduled.canvases, infos, strict=True):
            # the forward it waited for and the sampler's pass up to it
            r.turn.out.denoise_seconds += output.forward_seconds + time.perf_counter() - t0
            if r.on_step is not None:
                r.on_step(info)
            if r.canvas.done:
                self._finish_block(r)

    def _row_passes(self, canvases: list[Canvas], logits: list[torch.Tensor]) -> list[RowStats | None]:
        """One sampler row pass (`sampler.row_stats`) over each run of canvases whose `row_pass` keys agree and
        whose logits follow one another in one buffer (a batched pass's [B, C, V]), split into each canvas's
        rows; None for a canvas left to its own pass. The row pass computes each row alone: the same stats."""
        out: list[RowStats | None] = [None] * len(canvases)
        i = 0
        while i < len(canvases):
            key, j = canvases[i].row_pass(), i + 1
            while j < len(canvases) and canvases[j].row_pass() == key and follows(logits[j - 1], logits[j]):
                j += 1
            if j - i > 1:
                length, temp, sparse, need_probs, softcap, fast = key
                rows = logits[i].as_strided(((j - i) * length, logits[i].shape[1]), logits[i].stride())
                sc_out = None
                if sparse:  # the model's dtype, as a lone canvas's graph buffer is (`step_canvas`)
                    sc_out = torch.empty(rows.shape, device=rows.device, dtype=self.runner.dtype)
                stats = row_stats(rows, temp, sparse, need_probs, sc_out, softcap, fast)
                out[i:j] = split_rows(stats, j - i)
            i = j
        return out

    def _finish_block(self, r: Request) -> None:
        turn, canvas = r.turn, r.canvas
        r.canvas = None
        prop = turn.propose_from(canvas.result)
        kept_len = default_commit(turn, prop)
        if kept_len is None:
            turn.discard()
            return
        kept = turn.commit(kept_len)
        if r.on_commit is not None:
            r.on_commit(turn, kept)
