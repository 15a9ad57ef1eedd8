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
# Sets of caches (several canvases in one pass, `DenoiseGraphs.get_batch`) whose graphs are kept, least recently
# used dropped first: a server's running set changes as requests come and go, and an old set rarely returns.
BATCH_GRAPHS = 8


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
        # a set of caches' graphs by (mode, each cache's key); None: the set was seen once, not yet captured
        self._batch: dict[tuple, tuple[tuple[weakref.ref, ...], GraphStep | None]] = {}
        self._batch_out: torch.Tensor | None = None
        self._batch_sc: torch.Tensor | None = None

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
            if not self._any_live():
                self._pool = torch.cuda.graph_pool_handle()
            sc = None if sc is None else self.io(ids.shape[0])[1].copy_(sc)
            step = GraphStep(fn, ids, sc, self._pool)
            entry[1][mode] = step
        return step

    def _any_live(self) -> bool:
        return any(g for _, g in self._graphs.values()) or any(s for _, s in self._batch.values())

    def batch_out(self, rows: int) -> torch.Tensor:
        """Where a batched denoise pass of `rows` canvas rows writes its logits ([rows, V], the model's dtype): the
        first rows of one buffer as large as the largest batch yet (one buffer a batch size would hold 18 GB at the
        real shape once every size from 2 to 16 canvases had run)."""
        if self._batch_out is None or self._batch_out.shape[0] < rows:
            self._batch_out = torch.empty(rows, self.vocab, device=self.device, dtype=self.dtype)
        return self._batch_out[:rows]

    def batch_sc(self, rows: int) -> torch.Tensor:
        """The SC input a batched denoise graph of `rows` canvas rows reads ([rows, V], the embedding's dtype):
        the first rows of one buffer as large as the largest batch yet, as `batch_out`. A graph keeps the buffer
        it was captured on (`GraphStep.sc`), which the runner fills before each replay."""
        if self._batch_sc is None or self._batch_sc.shape[0] < rows:
            self._batch_sc = torch.zeros(rows, self.vocab, device=self.device, dtype=self.sc_dtype)
        return self._batch_sc[:rows]

    def get_batch(
        self,
        kvs: list[KVCache],
        mode: tuple,
        c: int,
        fn: Callable,
        x: torch.Tensor,
        sc: torch.Tensor | None = None,
    ) -> GraphStep | None:
        """The graph of `fn` (one pass over canvases of c rows, one after each of `kvs`, reading the SC input
        buffer `sc`) for this set of caches and their key buckets: None the first time the set comes (the caller
        runs `fn` eagerly), captured the second: a set that ran once may never return, one that ran twice is a
        batch's block of steps."""
        key = (mode, tuple(self._key(kv, c) for kv in kvs))
        refs, step = self._batch.pop(key, ((), None))
        # new, or a freed cache's id and memory reused: a graph never outlives its caches in use
        fresh = len(refs) != len(kvs) or any(r() is not kv for r, kv in zip(refs, kvs, strict=False))
        if fresh:
            refs, step = tuple(weakref.ref(kv) for kv in kvs), None
        elif step is None:
            if not self._any_live():
                self._pool = torch.cuda.graph_pool_handle()
            step = GraphStep(fn, x, sc, self._pool)
        self._batch[key] = (refs, step)  # the most recently used last
        while len(self._batch) > BATCH_GRAPHS:
            del self._batch[next(iter(self._batch))]
        return None if fresh else step

    def sc_input(self, kv: KVCache, c: int) -> torch.Tensor | None:
        """The SC input buffer of this cache's denoise graph with SC, if it was captured."""
        entry = self._graphs.get(self._key(kv, c))
        if entry is None or entry[0]() is not kv:
            return None
        step = entry[1].get((c, True, False))
        return None if step is None else step.sc

    def clear(self) -> None:
        self._graphs.clear()
        self._batch.clear()
        self._pool = None
        self._io.clear()
        self._batch_out = None
        self._batch_sc = None

    def __len__(self) -> int:
        solo = sum(len(graphs) for _, graphs in self._graphs.values())
        return solo + sum(step is not None for _, step in self._batch.values())
