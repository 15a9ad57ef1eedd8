"""The demo trainer's step as one CUDA graph.

An eager step of the small demo model is bound by kernel launches (thousands of small kernels for the
forward, self-conditioning pass, backward, clip and AdamW), not by the GPU. With fixed-shape batches
(`batches.BUCKETS`) the whole step can be captured once and replayed, reading static input buffers that the
step's batch is copied into. The step's host-side choices (self-conditioning on or off, the first pass's SC seed
on or off), the SC temperature and the learning rate are device tensors, so one graph serves every step: its
self-conditioning pass always runs, its probabilities zeroed when the step has none. The canvas noise comes from
the graph-safe CUDA generator, fresh on every replay.

One graph, not one per choice: with torch 2.11 on an H200, replaying a second captured step graph after the
first segfaulted on the host (each graph alone replays; docs/train/README.md).

The first step runs eagerly on a side stream (the warm-up a capture needs: cuBLAS handles, autograd's lazy
state, the optimizer's moments) and is a real training step; the capture that follows does not execute, so
every batch trains exactly once.
"""

from __future__ import annotations

import torch

from diffgemma.train.batches import Batch
from diffgemma.train.trainer import TrainConfig, step_body


class GraphedStep:
    """`trainer.step_body` replayed from one CUDA graph; call with host batches (pinned) and the step's choices."""

    def __init__(self, model, opt, cfg: TrainConfig, example: list[Batch], device: str, autocast):
        self.model, self.opt, self.cfg, self.autocast = model, opt, cfg, autocast
        self.static = [Batch(*(torch.empty_like(t, device=device) for t in b.tensors())) for b in example]
        self.temp = torch.ones((), device=device)
        self.sc = torch.zeros((), dtype=torch.bool, device=device)
        self.seed_first = torch.zeros((), dtype=torch.bool, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stats: torch.Tensor | None = None

    def _body(self) -> torch.Tensor:
        return step_body(
            self.model, self.opt, self.static, self.sc, self.seed_first, self.temp, self.cfg, self.autocast
        )

    def __call__(self, micro: list[Batch], sc: bool, seed_first: bool, temp: float) -> torch.Tensor:
        for dst, src in zip(self.static, micro, strict=True):
            for d, s in zip(dst.tensors(), src.tensors(), strict=True):
                d.copy_(s, non_blocking=True)
        self.temp.fill_(temp)
        self.sc.fill_(sc)
        self.seed_first.fill_(seed_first)
        if self.graph is not None:
            self.graph.replay()
            return self.stats.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stats = self._body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.stats = self._body()
        self.graph = graph
        return stats
