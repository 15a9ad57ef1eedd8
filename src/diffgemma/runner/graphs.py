"""CUDA graphs of the fast path: one captured forward, and the kept graphs of denoise steps and commits."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch

from diffgemma.model.kv_cache import KVCache

# Keys a graphed step's full layers attend over, masked past length + c: one capture per 1,024 cached tokens (4
# blocks of 256), not one per block, for at most 1,023 masked keys of extra work (docs/performance.md, "CUDA
# graphs").
FULL_KEY_BUCKET = 1024
# (cache, key bucket) pairs whose graphs are kept, least recently used dropped first (docs/performance.md, "CUDA
# graphs"): one-shot requests on the engine's cache, a conversation rewound below a bucket, and a server's
# requests alternating between conversations replay instead of capturing again.
GRAPH_BUCKETS = 16


class GraphStep:
    """One captured forward over static token ids (and SC input): a denoise step or a commit for a fixed (cache,
    key bucket, canvas length, SC mode), or a padded prefill into a staging cache for a fixed token count.

    The ids are copied into a static buffer; `sc` is the SC input buffer itself (the caller's, which several
    graphs may share). The output is the graph's static output. `fn` is not kept: what it refers to (a KV cache)
    may be freed while the graph lives, as long as the graph is not replayed then."""

    def __init__(self, fn, ids: torch.Tensor, sc: torch.Tensor | None, pool, warm_up: bool = True):
        self.ids = ids.clone()
        self.sc = sc
        if warm_up:  # outside capture: compiles, cuBLAS handles, SDPA workspaces
            stream = _warm_up_stream(torch.cuda.current_device())
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn(self.ids, self.sc)
            torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(self.ids, self.sc)

    def __call__(self, ids: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
        self.ids.copy_(ids, non_blocking=True)
        if self.sc is not None and sc is not self.sc:  # the sampler may have written it in place
            self.sc.copy_(sc, non_blocking=True)
        self.graph.replay()
        return self.out


@functools.cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device: torch keeps a cuBLAS workspace per (handle, stream) for the process's life,
    and with a new stream per capture memory grew ~64 MiB a key bucket (docs/performance.md, "CUDA graphs")."""
    return torch.cuda.Stream(device)


def full_keys(kv: KVCache, c: int) -> int:
    """Keys a graphed step's full layers attend over: length + c rounded up to FULL_KEY_BUCKET."""
    return min(kv.max_tokens + kv.canvas_slots, -(-(kv.length + c) // FULL_KEY_BUCKET) * FULL_KEY_BUCKET)


class DenoiseGraphs:
    """The denoise and commit graphs of the last GRAPH_BUCKETS (cache, key bucket) pairs, by mode. Every denoise
    graph of a canvas length writes one logits buffer and reads one SC input buffer (`io`), and all of them share
    one memory pool: they replay one at a time, and a step's output is read before the next replay."""

    def __init__(self, device: torch.device, vocab: int, dtype: torch.dtype, sc_dtype: torch.dtype) -> None:
        self.device, self.vocab, self.dtype, self.sc_dtype = device, vocab, dtype, sc_dtype
        self._graphs: dict[tuple, tuple[weakref.ref, dict[tuple, GraphStep]]] = {}
        self._pool = None
        self._io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def io(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits every denoise graph of canvas length c writes (before the softcap, the model's dtype,
        [c, V]) and the SC input they all read (the embedding's dtype, [c, V]), made on first use."""
        if c not in self._io:
            logits = torch.empty(c, self.vocab, device=self.device, dtype=self.dtype)
            self._io[c] = (logits, torch.zeros(c, self.vocab, device=self.device, dtype=self.sc_dtype))
        return self._io[c]

    @staticmethod
    def _key(kv: KVCache, c: int) -> tuple:
        return (id(kv), kv.k[0].data_ptr(), full_keys(kv, c))

    def get(
        self, kv: KVCache, mode: tuple, fn: Callable, ids: torch.Tensor, sc: torch.Tensor | None
    ) -> GraphStep:
        """The graph of `fn` for this cache, key bucket and mode, captured on first use (with `sc`, the SC input,
        copied into the shared buffer the graph reads)."""
        key = self._key(kv, ids.shape[0])
        entry = self._graphs.pop(key, None)
        # None yet, or a freed cache's (its id and memory reused): a graph never outlives its cache in use, as a
        # graph holds the cache only weakly (GraphStep keeps no reference to `fn`)
        if entry is None or entry[0]() is not kv:
            entry = (weakref.ref(kv), {})
        self._graphs[key] = entry  # the most recently used last
        while len(self._graphs) > GRAPH_BUCKETS:
            del self._graphs[next(iter(self._graphs))]
        step = entry[1].get(mode)
        if step is None:
            # Capturing into a pool none of whose graphs is alive failed (torch's allocator asserts): a new one.
            if not any(graphs for _, graphs in self._graphs.values()):
                self._pool = torch.cuda.graph_pool_handle()
            sc = None if sc is None else self.io(ids.shape[0])[1].copy_(sc)
            step = GraphStep(fn, ids, sc, self._pool)
            entry[1][mode] = step
        return step

    def sc_input(self, kv: KVCache, c: int) -> torch.Tensor | None:
        """The SC input buffer of this cache's denoise graph with SC, if it was captured."""
        entry = self._graphs.get(self._key(kv, c))
        if entry is None or entry[0]() is not kv:
            return None
        step = entry[1].get((c, True, False))
        return None if step is None else step.sc

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._io.clear()

    def __len__(self) -> int:
        return sum(len(graphs) for _, graphs in self._graphs.values())
