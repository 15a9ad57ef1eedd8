"""Many canvases per forward: `denoise_step` advances several canvases (each after its own cache, each under its own
sampler config) with one pass of the model, and `Scheduler` runs many turns on it, one forward a step for all of
their canvases. A block that finishes commits (its prefill runs before its turn's next canvas) while the others keep
denoising; a request's tokens do not depend on what shares its forward.

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

from diffgemma.engine.generate import (
    CancelToken,
    Canvas,
    StepInfo,
    Turn,
    default_commit,
    step_canvas,
    sync,
)
from diffgemma.model.kv_cache import KVCache
from diffgemma.runner.runner import DenoiseInput, ModelRunner

# Prompt tokens a scheduler step prefills while other requests denoise (`Scheduler._prefill_prompts`): ~25 ms on the
# H200 at 1k context, about one batched step of 4 canvases (docs/performance.md, "Many canvases per forward").
PREFILL_BUDGET = 1024


@torch.no_grad()
def denoise_step(runner: ModelRunner, items: list[tuple[Canvas, KVCache]]) -> list[StepInfo]:
    """One forward for every (canvas, cache) of equal canvas length, then each canvas's step: a lone canvas through
    the runner's own path (its graphs, `step_canvas`), several through `ModelRunner.denoise_many` (one that cannot
    share a pass, `ModelRunner.batches`, on its own)."""
    if not items:
        return []
    c = items[0][0].length
    if any(cv.length != c for cv, _ in items):
        raise ValueError("denoise_step takes canvases of one length")
    shared = [i for i, (_, kv) in enumerate(items) if runner.batches(kv, c)]
    infos: list[StepInfo | None] = [None] * len(items)
    if len(shared) > 1:
        inputs = [DenoiseInput(cv.ids, kv, *cv.sc_input()) for cv, kv in (items[i] for i in shared)]
        logits = runner.denoise_many(inputs)
        stops = []
        for b, i in enumerate(shared):
            cv = items[i][0]
            sc_out = None
            if cv.cfg.sc_sparse:  # in the model's dtype, as a lone canvas's buffer is (`step_canvas`)
                sc_out = torch.empty(c, logits.shape[-1], device=logits.device, dtype=runner.dtype)
            infos[i], stop = cv.advance(logits[b], sc_out)
            stops.append(stop)
        for b, stop in enumerate(torch.stack(stops).tolist()):  # one host read for the pass's canvases
            items[shared[b]][0].settle(stop, logits[b])
    for i, (cv, kv) in enumerate(items):
        if infos[i] is None:  # its SC input in its own buffer: the next forward may be another canvas's
            infos[i] = step_canvas(runner, cv, kv, private_sc=True)
    return infos


def prefill_pending(runner: ModelRunner, turns: list[Turn]) -> None:
    """`Turn.prefill_pending` of every turn: the commits that fit their canvas slots in one pass
    (`ModelRunner.commit_many`), the rest one by one."""
    due = [t for t in turns if t.pending and runner.commits_on_canvas(t.kv, len(t.pending))]
    if len(due) > 1:
        t0 = time.perf_counter()
        runner.commit_many([(t.pending, t.kv) for t in due])
        sync(runner.device)
        for t in due:
            t.pending = []
            t.out.prefill_seconds += time.perf_counter() - t0  # the pass it waited for
    for t in turns:
        t.prefill_pending()


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


class Scheduler:
    """Turns advanced together: each `step` opens a canvas for every turn that needs one (prefilling its last
    commit first), drops cancelled turns, advances every canvas by one step in forwards of at most `max_batch`
    canvases of one length, and commits (or re-rolls) the blocks that finished under the contract's policy
    (`default_commit`)."""

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

    def step(self) -> None:
        self._prefill_prompts()
        opening = [r for r in self.active if r.canvas is None and not r.turn.unprefilled]
        for r in self.active:  # a cancelled turn's prompt is in its cache, as a lone turn's would be
            if r.turn.unprefilled and r.cancel is not None and r.cancel.cancelled:
                r.turn.prefill_prompt()
                opening.append(r)
        # a commit is prefilled before its turn goes on or ends (cancelled), as a lone turn's is
        prefill_pending(self.runner, [r.turn for r in opening])
        live = []
        for r in self.active:
            if r.cancel is not None and r.cancel.cancelled:
                r.turn.propose_from(None)
                r.canvas = None
                continue
            if r.turn.unprefilled:  # its prompt goes on in the next step's budget
                continue
            if r.canvas is None:
                r.canvas = r.turn.canvas()
            live.append(r)
        groups: dict[int, list[Request]] = {}
        for r in live:  # forwards of at most max_batch canvases of one length
            groups.setdefault(r.canvas.length, []).append(r)
        batches = [
            g[i : i + self.max_batch] for g in groups.values() for i in range(0, len(g), self.max_batch)
        ]
        for group in batches:
            t0 = time.perf_counter()
            infos = denoise_step(self.runner, [(r.canvas, r.turn.kv) for r in group])
            self.forwards.append(len(group))
            for r, info in zip(group, infos, strict=True):
                r.turn.out.denoise_seconds += time.perf_counter() - t0  # the forward it waited for
                if r.on_step is not None:
                    r.on_step(info)
                if r.canvas.done:
                    self._finish_block(r)
        self.requests = self.active  # the finished leave

    def _prefill_prompts(self) -> None:
        """Prefill the prompts of turns that have not started, first come first: all of them while no canvas is
        denoising, else at most PREFILL_BUDGET tokens this step, so that a long prompt does not stall the running
        requests (chunked prefill)."""
        waiting = [r for r in self.active if r.turn.unprefilled]
        denoising = len(waiting) < len(self.active)
        budget = PREFILL_BUDGET if denoising else None
        for r in waiting:
            if budget is not None and budget <= 0:
                break
            n = r.turn.prefill_prompt(budget)
            if budget is not None:
                budget -= n

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

    def run(self) -> None:
        """Step until every submitted turn is done."""
        while self.active:
            self.step()
