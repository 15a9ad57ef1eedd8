"""The demo trainer's step as CUDA graphs.

An eager step of the small demo model is bound by kernel launches (thousands of small kernels for the
forward, self-conditioning pass, backward, clip and AdamW), not by the GPU. With fixed-shape batches
(`batches.BUCKETS`) the whole step can be captured once and replayed: one graph per host-side choice
(self-conditioning on or off, x the first-pass SC seed on or off), each reading static input buffers that the
step's batch is copied into. The SC temperature and the learning rate are device tensors, so they change
between replays without a recapture; the canvas noise comes from the graph-safe CUDA generator, fresh on
every replay.

The first step of each variant runs eagerly on a side stream (the warm-up a capture needs: cuBLAS handles,
autograd's lazy state) and is a real training step; the capture that follows does not execute, so every
batch trains exactly once.
"""

from __future__ import annotations

import torch

from diffgemma.train.batches import Batch
from diffgemma.train.trainer import TrainConfig, step_body


class GraphedStep:
    """`trainer.step_body` replayed from CUDA graphs; call with host batches (pinned) and the step's choices."""

    def __init__(self, model, opt, cfg: TrainConfig, example: list[Batch], device: str, autocast):
        self.model, self.opt, self.cfg, self.autocast = model, opt, cfg, autocast
        self.static = [Batch(*(torch.empty_like(t, device=device) for t in b.tensors())) for b in example]
        self.temp = torch.ones((), device=device)
        self.graphs: dict[tuple[bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _body(self, sc: bool, seed_first: bool) -> torch.Tensor:
        return step_body(
            self.model, self.opt, self.static, sc, seed_first, self.temp, self.cfg, self.autocast
        )

    def __call__(self, micro: list[Batch], sc: bool, seed_first: bool, temp: float) -> torch.Tensor:
        for dst, src in zip(self.static, micro, strict=True):
            for d, s in zip(dst.tensors(), src.tensors(), strict=True):
                d.copy_(s, non_blocking=True)
        self.temp.fill_(temp)
        key = (sc, seed_first)
        if key in self.graphs:
            graph, stats = self.graphs[key]
            graph.replay()
            return stats.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stats = self._body(sc, seed_first)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._body(sc, seed_first)
        self.graphs[key] = (graph, out)
        return stats
