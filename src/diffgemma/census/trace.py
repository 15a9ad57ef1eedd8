"""The denoise trace of one reply, recorded from the engine's `on_step` / `on_block` callbacks: per committed block
its kept tokens, their confidence (p_max) and accept state at the block's last step, and its steps; the steps of
re-rolled canvases apart. Nothing here re-runs the sampler: it reads the `StepInfo` the engine hands out."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffgemma.engine.generate import StepInfo


@dataclass
class BlockTrace:
    """One committed block: its kept tokens, each one's p_max and whether the last step accepted it, its steps."""

    tokens: list[int]
    p_max: list[float]
    accepted: list[bool]
    steps: int


@dataclass
class Trace:
    """A reply's blocks in commit order, and the denoise steps spent on canvases that were re-rolled."""

    blocks: list[BlockTrace] = field(default_factory=list)
    retry_steps: int = 0
    retries: int = 0


class TraceRecorder:
    """Pass `on_step` and `on_block` to `Engine.generate`; `trace` is the reply's `Trace` when it returns.

    A canvas starts at step 1; a canvas that another one follows before any commit was re-rolled (seed §9 #10).
    The last step's tensors are read at the commit, before the next forward can overwrite any buffer of theirs."""

    def __init__(self) -> None:
        self.trace = Trace()
        self._last: StepInfo | None = None

    def on_step(self, info: StepInfo) -> None:
        if info.step == 1 and self._last is not None:  # a canvas ended without a commit: it was re-rolled
            self.trace.retry_steps += self._last.step
            self.trace.retries += 1
        self._last = info

    def on_block(self, kept: list[int]) -> None:
        last = self._last
        if last is None:
            raise RuntimeError("a block was committed before any denoise step was seen")
        if last.p_max is None:
            raise RuntimeError("this engine's StepInfo carries no p_max: the census cannot read confidences")
        n = len(kept)
        p_max = last.p_max[:n].float().tolist()
        accepted = last.accepted[:n].tolist()
        self.trace.blocks.append(BlockTrace(list(kept), p_max, [bool(a) for a in accepted], last.step))
        self._last = None
