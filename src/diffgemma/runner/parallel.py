"""Expert parallel over torch.distributed: each rank keeps a contiguous share of every layer's experts. Rank 0
runs the engine (attention, routing, the dense MLP, the head, the sampler, the caches, a server); ranks 1.. only
serve their experts to it (`ModelRunner.follow`).

A layer's expert outputs are the sorted (row, expert) pairs' rows [N * k, H] (`Steps.experts`). Rank 0
broadcasts each expert call's rows and pair order; each rank computes its experts' pairs, leaves zeros in the
others, and one reduce sums them on rank 0. Every pair has exactly one owner, so the sum is its owner's value plus
zeros: rank 0 holds the one-process values exactly, and the combine, the sampler and the cache run on them as in
one process (the same tokens, bit for bit on CPU in fp32). Launched the standard way, one process a GPU (`torchrun
--nproc-per-node N`), NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist

from diffgemma.model.passes import COMMIT, DENOISE, PREFILL, TRAIN, Pass
from diffgemma.model.steps import Routing
from diffgemma.quant.weight import QuantWeight

# what a call's header codes: its pass phase and its tensors' dtypes
PHASES = (PREFILL, DENOISE, COMMIT, TRAIN)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)
STOP = -1  # a header's layer index that releases the followers
_leading = False  # this process is rank 0 of an expert parallel group, its followers not yet released


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


def join(processes: int, command: str) -> tuple[int, int]:
    """`init_from_env` for a command that asks for `processes` of them (`command`: its words, for the error);
    refuses any other launch in one line. Returns (rank, world size)."""
    rank, world = init_from_env()
    if world != processes:
        raise ValueError(
            f"{command} {processes} runs under torchrun --nproc-per-node {processes}; this is {world} process(es)"
        )
    return rank, world


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
            # a pack's experts: every stored tensor of a QuantWeight leads with the expert index
            if isinstance(w, QuantWeight):
                parts = {s: t[lo:hi].clone() for s, t in w.parts.items()}
                setattr(layer, name, QuantWeight(w.fmt, (hi - lo, *w.shape[1:]), parts))
            else:
                setattr(layer, name, torch.nn.Parameter(w.data[lo:hi].clone(), requires_grad=False))
    model.expert_shard = (lo, hi)
    return lo, hi


class ExpertParallelSteps:
    """Steps whose `experts` runs this rank's experts [lo, hi); every other step is the wrapped steps'.
    On rank 0 each call is sent to the other ranks first and their pairs summed in by a reduce; ranks 1.. run the
    calls rank 0 sends (`follow`). The pair range is read on the host (no CUDA graphs)."""

    def __init__(self, inner: Any, lo: int, hi: int) -> None:
        self.inner, self.lo, self.hi = inner, lo, hi
        self.rank = dist.get_rank()
        if self.rank == 0:
            global _leading
            _leading = True
            atexit.register(release)  # followers wait on rank 0 until it says so

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def experts(self, x: torch.Tensor, routing: Routing, layer: Any, p: Any) -> torch.Tensor:
        if self.rank != 0:
            raise RuntimeError(
                f"rank {self.rank} of an expert parallel group serves its experts to rank 0 "
                "(ModelRunner.follow); only rank 0 runs the model"
            )
        x, perm, bounds = x.contiguous(), routing.perm.contiguous(), routing.bounds.contiguous()
        k = routing.weights.shape[1]
        head = [layer.idx, x.shape[0], x.shape[1], perm.numel(), k, PHASES.index(p.phase), p.batch]
        head += [DTYPES.index(t.dtype) for t in (x, perm, bounds)]
        dist.broadcast(torch.tensor(head, dtype=torch.int64, device=x.device), 0)
        for t in (x, perm, bounds):
            dist.broadcast(t, 0)
        return self._share(x, routing, layer, p)

    def _share(self, x: torch.Tensor, routing: Routing, layer: Any, p: Any) -> torch.Tensor:
        """This rank's experts' pairs of the call, zeros elsewhere, summed over the ranks onto rank 0."""
        a, b = (int(i) for i in routing.bounds[[self.lo, self.hi]].tolist())
        y = x.new_zeros(routing.perm.numel(), x.shape[1])
        if b > a:  # this rank's experts own the sorted pairs a..b
            local = routing._replace(bounds=routing.bounds[self.lo : self.hi + 1] - a, perm=routing.perm[a:b])
            y[a:b] = self.inner.experts(x, local, layer, p)
        dist.reduce(y, 0)
        return y

    def follow(self, model: Any) -> None:
        """Ranks 1..: run rank 0's expert calls on this rank's share of `model` until rank 0 releases the group."""
        device = model.layers[0].experts_gate_up.device
        while True:
            head = torch.empty(10, dtype=torch.int64, device=device)
            dist.broadcast(head, 0)
            idx, n, hidden, pairs, k, phase, batch, xt, pt, bt = head.tolist()
            if idx == STOP:
                return
            x = torch.empty(n, hidden, dtype=DTYPES[xt], device=device)
            perm = torch.empty(pairs, dtype=DTYPES[pt], device=device)
            bounds = torch.empty(model.cfg.num_experts + 1, dtype=DTYPES[bt], device=device)
            for t in (x, perm, bounds):
                dist.broadcast(t, 0)
            # the steps' only reads of the routing and the pass: k, the pairs, and the phase and rows for a region
            routing = Routing(torch.empty(n, k), None, bounds, perm, None)
            p = Pass(PHASES[phase], [], 1, torch.empty(batch), [])
            self._share(x, routing, model.layers[idx], p)


def release() -> None:
    """Rank 0: let the followers of the group return from `follow` (once; at exit if not before)."""
    global _leading
    if not _leading or not dist.is_initialized():
        return
    _leading = False
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dist.broadcast(torch.full((10,), STOP, dtype=torch.int64, device=device), 0)


def leave() -> None:
    """Every rank, once its work is done: wait for the others and tear the group down, which exiting with it still
    up does not do cleanly (gloo's threads then abort one process at exit in ~1 run of 8: "terminate called
    without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
