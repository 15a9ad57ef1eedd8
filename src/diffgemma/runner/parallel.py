"""Expert parallel over torch.distributed: each rank keeps a contiguous share of every layer's experts and runs
the whole forward (attention, routing, the dense MLP, the head) on the same inputs as every other rank.

A layer's expert outputs are the sorted (row, expert) pairs' rows [N * k, H] (`Kernels.experts`); each rank
computes its experts' pairs, leaves zeros in the others, and one all-reduce sums them. Every pair has exactly one
owner, so the sum is its owner's value plus zeros: every rank then holds the one-process values exactly, and the
combine, the sampler and the cache run on them as in one process (the same tokens, bit for bit on CPU in fp32).
Launched the standard way, one process a GPU (`torchrun --nproc-per-node N`), NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from diffgemma.kernels.table import Routing


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """The experts [lo, hi) rank `rank` of `world` keeps: an equal contiguous share."""
    if num_experts % world:
        raise ValueError(
            f"expert parallel over {world} ranks needs a multiple of {world} experts, not {num_experts}"
        )
    share = num_experts // world
    return rank * share, (rank + 1) * share


def init_from_env() -> tuple[int, int]:
    """Join the process group a launcher (torchrun) describes in RANK / WORLD_SIZE / MASTER_ADDR ...: NCCL with
    this process's GPU (LOCAL_RANK) where CUDA is, else gloo. Returns (rank, world size); one process, no
    launcher: (0, 1), no group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def shard_experts(model: Any, world: int) -> tuple[int, int]:
    """Keep this rank's share of every layer's expert stacks (the rest freed); returns its range [lo, hi)."""
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise ValueError(
            f"expert_parallel={world} needs a torch.distributed group of {world} processes "
            f"(launch with torchrun --nproc-per-node {world})"
        )
    lo, hi = expert_range(model.cfg.num_experts, dist.get_rank(), world)
    held = getattr(model, "expert_shard", None)
    if (
        held is not None
    ):  # a second runner on the model: its stacks are already this share, or another world's
        if held != (lo, hi):
            raise ValueError(
                f"the model keeps experts {held} already; expert_parallel={world} wants {lo, hi}"
            )
        return lo, hi
    for layer in model.layers:
        for name in ("experts_gate_up", "experts_down"):
            w = getattr(layer, name)
            if not isinstance(w, torch.Tensor):
                raise ValueError(
                    "expert parallel runs bf16 or fp32 experts; a quantized pack's are not sharded yet"
                )
            setattr(layer, name, torch.nn.Parameter(w.data[lo:hi].clone(), requires_grad=False))
    model.expert_shard = (lo, hi)
    return lo, hi


class ExpertParallelKernels:
    """A kernel table whose `experts` runs this rank's experts [lo, hi) and sums every rank's by an all-reduce;
    every other step is the wrapped table's. The pair range is read on the host (no CUDA graphs)."""

    def __init__(self, inner: Any, lo: int, hi: int) -> None:
        self.inner, self.lo, self.hi = inner, lo, hi

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def experts(self, x: torch.Tensor, routing: Routing, layer: Any, p: Any) -> torch.Tensor:
        a, b = (int(i) for i in routing.bounds[[self.lo, self.hi]].tolist())
        y = x.new_zeros(routing.perm.numel(), x.shape[1])
        if b > a:  # this rank's experts own the sorted pairs a..b
            local = routing._replace(bounds=routing.bounds[self.lo : self.hi + 1] - a, perm=routing.perm[a:b])
            y[a:b] = self.inner.experts(x, local, layer, p)
        dist.all_reduce(y)
        return y
