"""The DiffusionGemma forward: one set of weights, two attention phases.

prefill(ids, kv)        causal encoder pass over new tokens; writes their K/V into the cache.
denoise(canvas, kv, …)  bidirectional decoder pass over a canvas that also attends to the cached prefix;
                        reads the cache, never writes it; returns softcapped logits (raw=True: before the
                        final softcap, which the sampler's row pass then applies).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from diffgemma.config import ModelConfig
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused as fused_ops
from diffgemma.kernels import torch_ref as ops
from diffgemma.model.kv_cache import KVCache

# Prefill tokens a pass: on an H200 at the real shape, an 8k prompt in chunks of 4096 ran at 45.8k tok/s, in
# chunks of 2048 at 35.1k (bench/results/README.md); in one process (bench/results/session20/), chunks of 8192
# against 4096: an 8k prompt 59.4k against 54.3k tok/s, 32k 45.7k against 43.4k, 128k 23.7k against 23.0k
# (16384: 58.8k, 46.5k and 23.9k, for 0.4 GiB more). `diffgemma bench` measures with this too.
PREFILL_CHUNK = 8192
# A prompt of up to PREFILL_GRAPH_MAX tokens into an empty cache is padded to a multiple of PREFILL_GRAPH_BUCKET
# and, on CUDA, replayed as a CUDA graph: eagerly, its ~950 launches bound it by the host (1,024 tokens on an
# H200: 57.6 ms wall for 25.8 ms of kernels; at 4,096 the kernels take longer than the host, 69 ms of 75).
# Measured in bench/results/prefill_host/.
PREFILL_GRAPH_MAX = 2048
PREFILL_GRAPH_BUCKET = 256
# A denoise graph reads the cache length on the device (`KVCache.denoise_geometry`) and covers the full layers'
# keys up to a multiple of this: one capture per 1,024 cached tokens (4 blocks of 256), not one per block, for at
# most 1,023 masked keys of extra work in the 5 full layers. Estimated, not measured: a capture ~35 ms
# (bench/results/generate_overhead/), 1,000 keys of the full layers' attention ~0.1 ms a step, so 1,024 saves
# ~26 ms a block of 48 steps for ~3 ms; 4,096 would save ~33 ms for ~11.
FULL_KEY_BUCKET = 1024
# (cache, key bucket) pairs whose denoise and commit graphs are kept, least recently used dropped first: one-shot
# requests of different lengths on the engine's cache, a conversation rewound below a bucket, or a server's
# requests alternating between conversations' caches replay instead of capturing again (two captures a bucket,
# ~0.14 s on the H200: bench/results/generate_overhead/session14_chat.json; a 1k request's block took 0.99 s
# alternating between two caches against 0.82 on one, when only one cache's graphs were kept:
# bench/results/session23/). A short chat turn's blocks alternate between two buckets: 3.39 s a turn kept against
# 3.72 recaptured (bench/results/session15/call1_s15.txt). Every graph writes its logits to, and reads its SC input
# from, one buffer per canvas length (`_graph_io`): when each kept its own, those took 0.62-0.64 GiB a bucket at
# the real shape (bench/results/session16/); their shared intermediates are in one memory pool.
GRAPH_BUCKETS = 16


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Layer(nn.Module):
    """One transformer layer. Parameter names follow the checkpoint (`model.decoder.layers.N.*`)."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        h, hd, nh, nkv = cfg.hidden_size, cfg.head_dims[idx], cfg.num_heads, cfg.num_kv_heads[idx]
        self.idx = idx
        self.sliding = cfg.is_sliding(idx)
        self.head_dim, self.n_heads, self.n_kv = hd, nh, nkv
        self.q_proj = _param(nh * hd, h)
        self.k_proj = _param(nkv * hd, h)
        # Full layers have no v_proj: V is the raw k_proj output (rms_norm_no_scale, no RoPE).
        self.v_proj = _param(nkv * hd, h) if self.sliding else None
        self.o_proj = _param(h, nh * hd)
        self.q_norm = _param(hd)
        self.k_norm = _param(hd)
        self.input_layernorm = _param(h)
        self.post_attention_layernorm = _param(h)
        self.pre_feedforward_layernorm = _param(h)
        self.post_feedforward_layernorm = _param(h)
        self.post_feedforward_layernorm_1 = _param(h)
        self.pre_feedforward_layernorm_2 = _param(h)
        self.post_feedforward_layernorm_2 = _param(h)
        self.mlp_gate = _param(cfg.intermediate_size, h)
        self.mlp_up = _param(cfg.intermediate_size, h)
        self.mlp_down = _param(h, cfg.intermediate_size)
        self.router_proj = _param(cfg.num_experts, h)
        self.router_scale = _param(h)
        self.per_expert_scale = _param(cfg.num_experts)
        self.experts_gate_up = _param(cfg.num_experts, 2 * cfg.moe_intermediate_size, h)
        self.experts_down = _param(cfg.num_experts, h, cfg.moe_intermediate_size)
        self.layer_scalar = _param(1)  # decoder's
        self.encoder_layer_scalar = _param(1)  # the encoder's copy (equal in real checkpoints)
        self.qkv_names = ("q_proj", "k_proj", "v_proj") if self.sliding else ("q_proj", "k_proj")
        self._merged: dict[tuple[str, ...], tuple[torch.Tensor, list[int]]] = {}

    def merged(self, *names: str) -> torch.Tensor:
        """The named [rows, hidden] weights as one [sum of rows, hidden] tensor ([q; k; v], [gate; up]): one
        GEMM in place of several, the output split by columns.

        Built on first use; the parameters then become views into it (the same Parameter objects, their
        `.data` re-pointed), so it costs no memory and in-place updates of a parameter reach it. A parameter
        replaced since (the loader sets new ones, `.to()` moves them) no longer points into it: it is rebuilt
        from the current parameters. Call it outside CUDA-graph capture first (the graph's warm-up does)."""
        parts = [getattr(self, n) for n in names]
        hit = self._merged.get(names)
        if hit is not None and hit[1] == [p.data_ptr() for p in parts]:
            return hit[0]
        w = torch.cat([p.detach() for p in parts])
        row = 0
        for p in parts:
            p.data = w[row : row + p.shape[0]]
            row += p.shape[0]
        self._merged[names] = (w, [p.data_ptr() for p in parts])
        return w

    def ffn_params(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The FFN half's weights for kernels/fused.moe_layer_ffn, in dtype (the dense gate/up merged)."""
        p = {
            name: getattr(self, name).to(dtype)
            for name in (
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "post_feedforward_layernorm",
                "mlp_down",
                "router_proj",
                "router_scale",
                "experts_gate_up",
                "experts_down",
                "layer_scalar",
            )
        }
        p["mlp_gate_up"] = self.merged("mlp_gate", "mlp_up").to(dtype)
        p["per_expert_scale"] = self.per_expert_scale
        return p


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = _param(cfg.vocab_size, h)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, h)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(h)
        self.sc_pre_norm = _param(h)
        self.sc_gate = _param(cfg.intermediate_size, h)
        self.sc_up = _param(cfg.intermediate_size, h)
        self.sc_down = _param(h, cfg.intermediate_size)
        self.inv_freq = {
            lt: ops.rope_inv_freq(
                cfg.head_dims[cfg.layer_types.index(lt)], rc.theta, rc.rope_type, rc.partial_rotary_factor
            )
            for lt, rc in cfg.rope.items()
        }
        # Fast path (kernels/cuda.py + a CUDA-graph denoise step): None = decided from the device of the
        # weights (on for cuda); True/False forces it (True on cpu runs the fast ops without graphs).
        self.fast: bool | None = None
        self.use_graphs = True
        # Fused denoise layers (kernels/fused.py, torch.compile'd regions) on the fast path: None = on for cuda,
        # True/False forces it (True on cpu compiles for the cpu, which is how it is smoke-tested).
        self.fuse: bool | None = None
        self.fused_regions = fused_ops.make_regions()
        # The same regions for the prefill (also on when is_fused): compiled with a symbolic token count.
        self.prefill_regions = fused_ops.make_regions(dynamic=True)
        # The denoise and commit graphs: (cache, key bucket) -> (the cache, weakly) and its graphs by mode, the
        # least recently used first
        self._graphs: dict[tuple, tuple[weakref.ref, dict[tuple, fast_ops.GraphStep]]] = {}
        self._graph_pool = None  # one memory pool for them: they replay one at a time
        # canvas length -> the logits every denoise graph writes and the SC input they read (`_graph_buffers`)
        self._graph_io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._geometry: torch.Tensor | None = None  # the denoise's `KVCache.denoise_geometry`, on the device
        self._prefill_graphs: dict[int, fast_ops.GraphStep | None] = {}  # bucket -> graph (None: ran eagerly)
        self._prefill_stage: KVCache | None = None  # where `_prefill_padded` writes K/V
        self._prefill_pool = None  # one memory pool for those graphs: none keeps a live output in it

    # -- public API ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def is_fast(self) -> bool:
        if self.fast is None:  # grouped_mm on CUDA is a bf16 kernel
            return self.device.type == "cuda" and self.dtype == torch.bfloat16
        return bool(self.fast)

    @property
    def is_fused(self) -> bool:
        if self.fuse is None:
            return self.is_fast and self.device.type == "cuda"
        return bool(self.fuse) and self.is_fast

    def new_cache(self, max_tokens: int = 4096, ring_size: int | None = None) -> KVCache:
        return KVCache(self.cfg, max_tokens, self.device, self.dtype, ring_size=ring_size)

    @torch.no_grad()
    def prefill(
        self,
        ids: torch.Tensor,
        kv: KVCache,
        chunk: int = PREFILL_CHUNK,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """Causally encode ids [1, T] at positions kv.length.. and extend the cache by T, `chunk` tokens a pass.

        `compute_dtype` (e.g. fp32 for short prompts, seed §3) runs activations in that dtype; the cache keeps its own.
        The reference path (`_prefill_aligned`) gives every position the same K/V however the tokens were split
        into prefills; the fast path chunks for speed.
        """
        new = ids.reshape(-1).tolist()
        ids = self._check_ids(ids)
        if kv.length + ids.shape[1] > kv.max_tokens:
            raise ValueError(
                f"prompt does not fit: {kv.length} cached + {ids.shape[1]} new > {kv.max_tokens}"
            )
        known = kv.knows_tokens()
        self._prefill_routed(ids, kv, chunk, compute_dtype or self.dtype)
        if known:
            kv.tokens.extend(new)

    def _prefill_routed(self, ids: torch.Tensor, kv: KVCache, chunk: int, dtype: torch.dtype) -> None:
        t = ids.shape[1]
        if not self.is_fast:
            self._prefill_aligned(ids[0], kv, dtype)
            return
        if (
            kv.length == 0
            and 0 < t <= min(chunk, PREFILL_GRAPH_MAX)
            and self.is_fused
            and dtype == self.dtype
        ):
            self._prefill_padded(ids[0], kv)
            return
        if kv.length > 0 and 0 < t <= kv.canvas_slots and dtype == self.dtype and self._fused_for(kv, t):
            self._commit(ids[0], kv)
            return
        for s in range(0, t, chunk):
            part = ids[:, s : s + chunk]
            self._encode(part[0], kv, dtype)

    @torch.no_grad()
    def rewind(self, kv: KVCache, pos: int) -> None:
        """Drop every position >= pos (`KVCache.truncate`); on the reference path, then encode the chunk that now
        ends the cache again from its own tokens, so that the cache holds what a prefill of its tokens from
        empty would (`_prefill_aligned`): a rewind restores the K/V bytes of the shorter cache exactly."""
        kv.truncate(pos)
        redo = pos % self.cfg.canvas_length
        if self.is_fast or not redo or not kv.knows_tokens() or not kv.can_truncate(pos - redo):
            return
        tokens = kv.tokens[pos - redo :]
        kv.truncate(pos - redo)
        self.prefill(torch.tensor([tokens]), kv)

    def _prefill_aligned(self, ids: torch.Tensor, kv: KVCache, dtype: torch.dtype) -> None:
        """ids [T] after the cache in chunks of one canvas at fixed absolute positions (0, C, 2C, ...), each padded
        to C rows: a cache that ends inside a chunk has that chunk's cached part encoded again with the new
        tokens. Every chunk is then the same computation whatever came before it, so a conversation's K/V, and its
        answers, do not depend on how its turns were prefilled or what the cache held (CPU fp32: bit for bit).
        The pad rows come after every real one (causal: no real row sees them) and write nothing."""
        c, start = self.cfg.canvas_length, kv.length
        redo = start % c
        if redo and kv.knows_tokens() and kv.can_truncate(start - redo):
            ids = torch.cat([torch.tensor(kv.tokens[start - redo : start], device=ids.device), ids])
            kv.length = start - redo  # re-encoded below, to the same length and tokens
        pad = self.cfg.pad_token_id or 0
        for s in range(0, ids.shape[0], c):
            part = ids[s : s + c]
            self._encode(F.pad(part, (0, c - part.shape[0]), value=pad), kv, dtype, valid=part.shape[0])

    def _prefill_padded(self, ids: torch.Tensor, kv: KVCache) -> None:
        """ids [T] into the empty cache `kv`, encoded padded with pad tokens to a multiple of
        PREFILL_GRAPH_BUCKET (causal attention: no prompt row sees them) into a staging cache, whose first T
        positions are then copied into `kv`. On CUDA a bucket's second prompt captures a graph that the later
        ones replay; its first runs eagerly, and so compiles what the capture needs. Eager or replayed, the
        shapes are the bucket's: a prompt leaves the same cache either way."""
        t = ids.shape[0]
        tb = -(-t // PREFILL_GRAPH_BUCKET) * PREFILL_GRAPH_BUCKET
        padded = F.pad(ids, (0, tb - t), value=self.cfg.pad_token_id or 0)
        if self._prefill_stage is None:  # a ring as long as the cache: every layer keeps positions in order
            self._prefill_stage = self.new_cache(PREFILL_GRAPH_MAX, ring_size=PREFILL_GRAPH_MAX)
        stage = self._prefill_stage
        stage.reset()
        step = self._prefill_graphs.get(tb)
        if step is None and tb in self._prefill_graphs and self.use_graphs and self.device.type == "cuda":
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            step = fast_ops.GraphStep(
                lambda i, _: self._encode(i, stage, self.dtype),
                padded,
                None,
                self._prefill_pool,
                warm_up=False,
            )
            self._prefill_graphs[tb] = step
        if step is not None:
            step(padded, None)
        else:
            self._encode(padded, stage, self.dtype)
            self._prefill_graphs[tb] = None
        for layer in self.layers:
            kv.write(layer.idx, 0, stage.kv[layer.idx][:, :, :t])
        kv.length = t

    @torch.no_grad()
    def denoise(
        self,
        canvas_ids: torch.Tensor,
        kv: KVCache,
        sc_logits: torch.Tensor | None = None,
        *,
        sc_probs: torch.Tensor | None = None,
        sc_seed: bool = False,
        raw: bool = False,
    ) -> torch.Tensor:
        """Logits [1, C, V] (fp32, softcapped) for a canvas [1, C] placed after the cache.

        Self-conditioning: `sc_logits` as transformers' `self_conditioning_logits` (probs = their softmax), or
        `sc_probs` already normalised, or `sc_seed` (the first-step seed: the canvas's own embedding), or none.
        raw=True returns the LM head's output before the final softcap, in the model's dtype, for the sampler's
        row pass to softcap as it reads it (cfg.final_logit_softcapping); on the graphed path that is the graph's
        own buffer, which the next step overwrites (the sampler loop reads it before).
        """
        canvas = self._check_ids(canvas_ids)[0]
        if sc_logits is not None:
            sc_probs = torch.softmax(sc_logits.reshape(canvas.shape[0], -1), dim=-1, dtype=torch.float32)
        if self._fused_for(kv, canvas.shape[0]):
            self._load_geometry(kv, canvas.shape[0])  # before a replay: the graph reads it
            if self.use_graphs and self.device.type == "cuda":
                out = self._denoise_graphed(canvas, kv, sc_probs, sc_seed and sc_probs is None)
                return (out if raw else self._softcap(out))[None]
        return self._denoise_forward(canvas, kv, sc_probs, sc_seed, raw=raw)[None]

    def _denoise_forward(
        self,
        canvas: torch.Tensor,
        kv: KVCache,
        sc_probs: torch.Tensor | None,
        sc_seed: bool,
        out: torch.Tensor | None = None,
        raw: bool = False,
    ) -> torch.Tensor:
        h = self._decoder_input(canvas, sc_probs, sc_seed)
        h = self._decode_layers(h, kv)
        return self._logits(h, out, raw)

    def _denoise_graphed(
        self, canvas: torch.Tensor, kv: KVCache, sc_probs: torch.Tensor | None, sc_seed: bool
    ) -> torch.Tensor:
        """Replay (capturing on first use) the fused denoise graph for this cache, key bucket and mode."""
        mode = (canvas.shape[0], sc_probs is not None, sc_seed)
        out = self._graph_buffers(canvas.shape[0])[0]
        step = self._graph(
            kv,
            mode,
            lambda ids, p: self._denoise_forward(ids, kv, p, sc_seed, out, raw=True),
            canvas,
            sc_probs,
        )
        return step(canvas, sc_probs)

    def _graph_buffers(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits every denoise graph of canvas length c writes (before the softcap, the model's dtype,
        [c, V]) and the SC input they all read (the embedding's dtype, [c, V]), made on first use."""
        if c not in self._graph_io:
            v = self.cfg.vocab_size
            logits = torch.empty(c, v, device=self.device, dtype=self.dtype)
            self._graph_io[c] = (logits, torch.zeros(c, v, device=self.device, dtype=self.embed.dtype))
        return self._graph_io[c]

    def _graph(self, kv: KVCache, mode: tuple, fn, ids: torch.Tensor, sc: torch.Tensor | None):
        """The captured graph of `fn` (a denoise step or a commit over the canvas slots) for this cache, key bucket
        and mode, captured on first use (with `sc`, the SC input, copied into the shared buffer its GEMM reads).
        The graphs read the cache length on the device, so one serves every block until the full layers' keys
        outgrow their bucket; the last GRAPH_BUCKETS (cache, bucket) pairs' graphs are kept."""
        key = (self._graph_key(kv), self._full_keys(kv, ids.shape[0]))
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
            # A shared pool is safe: a step's output is read before the next replay overwrites it (raw=True),
            # and the inputs (ids, SC) and the logits are buffers outside the pool. Capturing into a pool none of
            # whose graphs is alive failed (torch 2.11's allocator asserts, bench/results/session15/): a new one.
            if not any(graphs for _, graphs in self._graphs.values()):
                self._graph_pool = torch.cuda.graph_pool_handle()
            sc = None if sc is None else self._graph_buffers(ids.shape[0])[1].copy_(sc)
            step = fast_ops.GraphStep(fn, ids, sc, self._graph_pool)
            entry[1][mode] = step
        return step

    def compile_regions(self, on: bool) -> None:
        """torch.compile the fused path's regions (the default), or run them eagerly inside the same CUDA graphs.
        Compiling costs a process's first reply ~7 s on an H200 with torch's on-disk caches warm (~23 s without)
        and saves 4.6 ms a denoise step (16.1 against 20.7 ms at 1k), so it pays back after ~1,300 steps (~27
        blocks of 48; bench/results/session23/): worth it for a server or a chat, not for one short reply."""
        self.fused_regions = fused_ops.make_regions(enabled=on)
        self.prefill_regions = fused_ops.make_regions(enabled=on, dynamic=True)
        self.release_graphs()  # graphs captured around the other regions
        self._prefill_graphs.clear()
        self._prefill_pool = None  # a capture into a pool none of whose graphs lives fails (see `_graph`)

    def release_graphs(self) -> None:
        """Drop the denoise and commit graphs (each tied to the cache it was captured on), their memory pool and
        their shared buffers."""
        self._graphs.clear()
        self._graph_pool = None
        self._graph_io.clear()

    def sc_input_buffer(self, kv: KVCache, canvas_len: int) -> torch.Tensor | None:
        """The captured denoise graph's SC input for this cache and canvas length, if there is one ([C, V] in the
        model's dtype): SC probabilities written there are not copied in again by the next `denoise`."""
        entry = self._graphs.get((self._graph_key(kv), self._full_keys(kv, canvas_len)))
        if entry is None or entry[0]() is not kv:
            return None
        step = entry[1].get((canvas_len, True, False))
        return None if step is None else step.sc

    @staticmethod
    def _graph_key(kv: KVCache) -> tuple:
        return (id(kv), kv.k[0].data_ptr())

    @staticmethod
    def _full_keys(kv: KVCache, c: int) -> int:
        """Keys a fused denoise step's full layers attend over, masked past length + c: FULL_KEY_BUCKET steps."""
        return min(kv.max_tokens + kv.canvas_slots, -(-(kv.length + c) // FULL_KEY_BUCKET) * FULL_KEY_BUCKET)

    def _fused_for(self, kv: KVCache, c: int) -> bool:
        """Whether a denoise over `kv` with a canvas of c runs the fused layers: they write the canvas's K/V
        into the cache's own slots, so the cache must hold the model's dtype and have room for the canvas."""
        return self.is_fused and kv.dtype == self.dtype and c <= kv.canvas_slots

    def _load_geometry(self, kv: KVCache, c: int) -> None:
        """`kv.denoise_geometry(c)` into the device buffer the fused denoise layers read (a graph too)."""
        if self._geometry is None or self._geometry.device != self.device:
            self._geometry = torch.zeros(5, dtype=torch.int32, device=self.device)
        self._geometry.copy_(torch.tensor(kv.denoise_geometry(c), dtype=torch.int32))

    # -- pieces ----------------------------------------------------------------------------

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"expected token ids shaped [1, T], got {tuple(ids.shape)}")
        # Ids already on the GPU come from the sampler: checking them would cost a host sync every step.
        if (
            ids.numel()
            and ids.device.type != "cuda"
            and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size)
        ):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return ids.to(self.device)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        # transformers rounds sqrt(hidden) to the embedding dtype (55.43 -> 55.5 in bf16): mirror it.
        # A Python float (not a cpu tensor) so that a CUDA graph can capture the product.
        return float(torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=self.embed.dtype).to(dtype))

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # F.embedding, not self.embed[ids]: the same rows, but its backward is a dense scatter-add where the
        # indexing backward sorts; that sort was 40% of the demo trainer's GPU time (measured on an H200).
        return F.embedding(ids, self.embed) * self._embed_scale(self.embed.dtype)

    def _decoder_input(
        self, canvas: torch.Tensor, sc_probs: torch.Tensor | None, sc_seed: bool
    ) -> torch.Tensor:
        """Token embeddings + the SC MLP on the soft signal, then rms_norm_no_scale (seed §4.1)."""
        cfg = self.cfg
        emb = self._embed_tokens(canvas)
        if sc_probs is not None:
            soft = (sc_probs.to(self.embed.dtype) @ self.embed) * self._embed_scale(emb.dtype)
        elif sc_seed:
            soft = emb
        else:  # the SC MLP of a zero signal is exactly zero
            return ops.rms_norm(emb, None, cfg.rms_norm_eps)
        x = ops.rms_norm(soft, self.sc_pre_norm, cfg.rms_norm_eps)
        sc = F.linear(ops.gelu_tanh(F.linear(x, self.sc_gate)) * F.linear(x, self.sc_up), self.sc_down)
        return ops.rms_norm(emb + sc, None, cfg.rms_norm_eps)

    def _logits(self, h: torch.Tensor, out: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        """Softcapped fp32 logits [C, V], or (raw) the LM head's output before the softcap, into `out` when given
        (a graph's shared buffer)."""
        h = ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        head = (self.embed if self.lm_head is None else self.lm_head).to(h.dtype)
        logits = F.linear(h, head) if out is None else torch.mm(h, head.t(), out=out)
        return logits if raw else self._softcap(logits)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The final softcap in fp32 (a new tensor): one compiled pass on the fused path, else the torch ops."""
        cap = self.cfg.final_logit_softcapping
        return self.fused_regions["softcap"](logits, cap) if self.is_fused else ops.softcap(logits, cap)

    def _inv_freq(self, layer: Layer, device: torch.device) -> torch.Tensor:
        lt = self.cfg.layer_types[layer.idx]
        if self.inv_freq[lt].device != device:  # move once: a host copy cannot sit inside a CUDA graph
            self.inv_freq[lt] = self.inv_freq[lt].to(device)
        return self.inv_freq[lt]

    def _qkv(self, layer: Layer, x: torch.Tensor, positions: torch.Tensor):
        """Q [1,H,T,d], K and V [1,Hkv,T,d] for x [T, hidden] at `positions`."""
        eps = self.cfg.rms_norm_eps
        t, hd = x.shape[0], layer.head_dim
        q = F.linear(x, layer.q_proj.to(x.dtype)).view(t, layer.n_heads, hd)
        k_raw = F.linear(x, layer.k_proj.to(x.dtype)).view(t, layer.n_kv, hd)
        v = F.linear(x, layer.v_proj.to(x.dtype)).view(t, layer.n_kv, hd) if layer.sliding else k_raw
        cos, sin = ops.rope_cos_sin(self._inv_freq(layer, positions.device), positions, x.dtype)
        q = ops.apply_rope(ops.rms_norm(q, layer.q_norm, eps), cos, sin)
        k = ops.apply_rope(ops.rms_norm(k_raw, layer.k_norm, eps), cos, sin)
        v = ops.rms_norm(v, None, eps)
        return q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def _ffn(self, layer: Layer, h: torch.Tensor, experts=None) -> torch.Tensor:
        """Dense MLP and MoE in parallel on the post-attention stream, seven norms in all. `experts` overrides
        the expert kernel (the trainer's differentiable all-experts sum)."""
        eps = self.cfg.rms_norm_eps
        dt = h.dtype
        x = ops.rms_norm(h, layer.pre_feedforward_layernorm, eps)
        dense = F.linear(
            ops.gelu_tanh(F.linear(x, layer.mlp_gate.to(dt))) * F.linear(x, layer.mlp_up.to(dt)),
            layer.mlp_down.to(dt),
        )
        dense = ops.rms_norm(dense, layer.post_feedforward_layernorm_1, eps)
        weights, ids = ops.route(
            h,
            layer.router_proj.to(dt),
            layer.router_scale.to(dt),
            layer.per_expert_scale,
            self.cfg.top_k_experts,
            eps,
        )
        x2 = ops.rms_norm(h, layer.pre_feedforward_layernorm_2, eps)
        if experts is None and self.is_fast:  # in x2's dtype, without a copy of the experts in it
            moe = fast_ops.moe_experts(x2, weights, ids, layer.experts_gate_up, layer.experts_down)
        else:
            experts = experts or ops.moe_experts
            moe = experts(x2, weights, ids, layer.experts_gate_up.to(dt), layer.experts_down.to(dt))
        moe = ops.rms_norm(moe, layer.post_feedforward_layernorm_2, eps)
        return ops.rms_norm(dense + moe, layer.post_feedforward_layernorm, eps)

    def _layer(self, layer: Layer, h: torch.Tensor, attend, scalar: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        attn = attend(ops.rms_norm(h, layer.input_layernorm, eps))  # [T, H*d]
        attn = F.linear(attn, layer.o_proj.to(h.dtype))
        h = h + ops.rms_norm(attn, layer.post_attention_layernorm, eps)
        h = h + self._ffn(layer, h)
        return h * scalar.to(h.dtype)

    def _encode(self, ids: torch.Tensor, kv: KVCache, dtype: torch.dtype, valid: int | None = None) -> None:
        """Causal pass over ids [T] at kv.length..; no pre-layer norm on the encoder input (seed §2). `valid`: on
        the reference path, how many rows are real (the rest is padding, whose K/V are not written)."""
        start, t = kv.length, ids.shape[0]
        n = t if valid is None else valid
        positions = torch.arange(start, start + t, device=self.device)
        h = self._embed_tokens(ids).to(dtype)
        fast = self.is_fast
        bias = self._window_bias(kv, t, dtype) if fast else None
        if self.is_fused and dtype == self.dtype:  # each layer's last region also norms the next's input
            x, rope = None, {}
            for layer, nxt in zip(self.layers, [*self.layers[1:], None], strict=True):
                norm = None if nxt is None else nxt.input_layernorm
                h, x = self._encode_layer_fused(layer, h, kv, positions, rope, x, norm, bias)
            kv.length = start + t
            return
        for layer in self.layers:

            def attend(x: torch.Tensor, layer: Layer = layer) -> torch.Tensor:
                q, k, v = self._qkv(layer, x, positions)
                if fast:
                    return self._prefill_attention_fast(layer, q, torch.cat([k, v]), kv, bias)
                past_k, past_v, past_pos = kv.read(layer.idx, start)
                keys = torch.cat([past_k.to(k.dtype), k], dim=2)
                vals = torch.cat([past_v.to(v.dtype), v], dim=2)
                key_pos = torch.cat([past_pos, positions])
                mask = key_pos[None, :] <= positions[:, None]
                if layer.sliding:
                    mask &= key_pos[None, :] > positions[:, None] - self.cfg.sliding_window
                kv.write(layer.idx, start, torch.cat([k, v])[:, :, :n])
                out = ops.attention(q, keys, vals, mask)
                return ops.rows(out)

            h = self._layer(layer, h, attend, layer.encoder_layer_scalar)
        kv.length = start + n

    def _window_bias(self, kv: KVCache, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The sliding layers' attention mask for a prefill chunk of t tokens after the cache (`window_bias`):
        the same for all of them, as they all see the same key positions."""
        sliding = [layer for layer in self.layers if layer.sliding]
        if not sliding:
            return None
        w = self.cfg.sliding_window
        groups = sliding[0].n_heads // sliding[0].n_kv
        return fast_ops.window_bias(min(kv.length, w - 1), t, w, groups, dtype, self.device)

    def _prefill_attention_fast(
        self, layer: Layer, q: torch.Tensor, chunk: torch.Tensor, kv: KVCache, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The fast ops' causal attention of a prefill chunk (q [1,H,T,d], its K and V stacked [2,Hkv,T,d],
        at positions kv.length..) over the cached past and itself, as rows [T, H*d]; writes the chunk's K/V
        into the cache. `bias`: the chunk's `_window_bias`."""
        start, t = kv.length, q.shape[2]
        # A sliding layer's window is copied into the attention's buffer before the write may overwrite it.
        if layer.sliding:
            out = fast_ops.attention_window(q, kv.span(layer.idx, start).to(q.dtype), chunk, bias)
            kv.write(layer.idx, start, chunk)
            return out
        kv.write(layer.idx, start, chunk)
        if chunk.dtype == kv.dtype:  # the past, then the chunk just written: one view of the cache
            both = kv.span(layer.idx, start + t)
        else:
            both = torch.cat([kv.span(layer.idx, start).to(chunk.dtype), chunk], dim=2)
        return fast_ops.attention_causal_past(q, both[0:1], both[1:2])

    def _encode_layer_fused(
        self,
        layer: Layer,
        h: torch.Tensor,
        kv: KVCache,
        positions: torch.Tensor,
        rope: dict,
        x: torch.Tensor | None,
        next_norm: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One encoder layer on a prefill chunk h [T, hidden]: the fast path's math as the prefill regions
        (kernels/fused.py, compiled for any T) around the library GEMMs and the same attention calls.

        `rope`: the chunk's cos/sin tables by layer type (`_fused_qkv`); `x`: this layer's normed input when the
        previous layer made it; `next_norm`: the next layer's input_layernorm, applied in this layer's last
        region. Returns (h, the next layer's normed input)."""
        r = self.prefill_regions
        q, chunk = self._fused_qkv(layer, h, x, r, positions, rope)
        attn_rows = self._prefill_attention_fast(layer, q, chunk, kv, bias)
        return self._fused_ffn_half(layer, h, attn_rows, r, layer.encoder_layer_scalar, next_norm)

    def _fused_qkv(
        self,
        layer: Layer,
        h: torch.Tensor,
        x: torch.Tensor | None,
        regions: dict,
        positions: torch.Tensor,
        rope: dict,
        kv_out: torch.Tensor | None = None,
        kv_slot: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged q/k/v GEMM of a fused layer on h [T, hidden] (its normed input x made here unless the
        previous layer made it), then the Q/K norms, RoPE and V's norm: q [1, H, T, d] and K/V stacked
        [2, Hkv, T, d], written into `kv_out` when given (with `kv_slot`, int32 [1] on the device: kv_out is a
        layer's cache buffer and token t goes to slot kv_slot[0] + t). The Triton kernel (`triton_qkv`) where it
        runs, with `rope` the step's cos/sin tables per layer type (filled here on first use); else the region."""
        t, hd, nq, nkv, eps = h.shape[0], layer.head_dim, layer.n_heads, layer.n_kv, self.cfg.rms_norm_eps
        if x is None:
            x = regions["norm"](h, layer.input_layernorm, eps)
        qkv = F.linear(x, layer.merged(*layer.qkv_names).to(h.dtype))  # [T, (nq + nkv [+ nkv]) * hd]
        inv_freq = self._inv_freq(layer, positions.device)
        tq = fast_ops.triton_qkv_for(qkv, hd)
        if tq is not None:
            lt = self.cfg.layer_types[layer.idx]
            if lt not in rope:
                rope[lt] = ops.rope_cos_sin(inv_freq, positions, h.dtype)
            try:
                return tq.norm_rope(
                    qkv, nq, nkv, layer.sliding, *rope[lt], layer.q_norm, layer.k_norm, eps, kv_out, kv_slot
                )
            except Exception as e:  # noqa: BLE001 - any failure: the compiled region from then on, loudly
                fast_ops.triton_failed("triton_qkv", e)
        q = qkv[:, : nq * hd].view(t, nq, hd)
        k_raw = qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
        v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd) if layer.sliding else None
        q, kv_new = regions["qkv_post"](
            q, k_raw, v, layer.q_norm, layer.k_norm, inv_freq, positions, eps, True
        )
        if kv_slot is not None:
            kv_out.index_copy_(2, kv_slot.long() + torch.arange(t, device=kv_slot.device), kv_new)
            return q, kv_out
        if kv_out is not None:
            kv_out.copy_(kv_new)
            return q, kv_out
        return q, kv_new

    def _fused_ffn_half(
        self,
        layer: Layer,
        h: torch.Tensor,
        attn_rows: torch.Tensor,
        regions: dict,
        scalar: torch.Tensor,
        next_norm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A fused layer from its attention output attn_rows [T, H*d]: o_proj, then the FFN half
        (fused.moe_layer_ffn on `regions`) ending in `scalar` (the decoder's or the encoder's layer scalar)
        and, with `next_norm`, the next layer's normed input. Returns (h, that input or None)."""
        dt = h.dtype
        attn = F.linear(attn_rows, layer.o_proj.to(dt))
        p = layer.ffn_params(dt)
        p["layer_scalar"] = scalar.to(dt)
        res = fused_ops.moe_layer_ffn(
            h, attn, p, self.cfg.rms_norm_eps, self.cfg.top_k_experts, regions, next_norm
        )
        return res if next_norm is not None else (res, None)

    def _decode_layers(self, h: torch.Tensor, kv: KVCache) -> torch.Tensor:
        c = h.shape[0]
        if self._fused_for(kv, c):
            return self._fused_layers(h, kv, causal=False)
        positions = torch.arange(kv.length, kv.length + c, device=self.device)
        for layer in self.layers:
            h = self._decode_layer(layer, h, kv, positions)
        return h

    def _fused_layers(self, h: torch.Tensor, kv: KVCache, causal: bool) -> torch.Tensor:
        """The fused layers over the canvas slots (`_load_geometry` loaded the geometry): a denoise step's, or with
        `causal` a commit's. Each layer's last region also norms the next layer's input."""
        c = h.shape[0]
        positions = self._geometry[0] + torch.arange(c, device=self.device)
        x, rope, keys = None, {}, self._full_keys(kv, c)
        for layer, nxt in zip(self.layers, [*self.layers[1:], None], strict=True):
            norm = None if nxt is None else nxt.input_layernorm
            h, x = self._decode_layer_fused(layer, h, kv, positions, rope, keys, x, norm, causal)
        return h

    def _commit(self, ids: torch.Tensor, kv: KVCache) -> None:
        """ids [t] (t <= the canvas slots) after a non-empty cache (a block's commit, a short turn): `_encode`'s
        causal pass run as the fused denoise layers run, on the canvas slots, padded with pad tokens to the
        canvas (causal: no real row sees them), and graphed on CUDA like the denoise step. At the real shape on
        the H200, 256 tokens after 1,024: 19.1-19.3 ms against 31.9-35.0 for `_encode`, whose ~700 eager launches
        kept the GPU waiting (16.2 ms of kernels; bench/results/session21/). The canvas slots are the full
        layers' own positions; a sliding layer's K/V are then written to its ring from there."""
        c, t, start = kv.canvas_slots, ids.shape[0], kv.length
        padded = F.pad(ids, (0, c - t), value=self.cfg.pad_token_id or 0)
        self._load_geometry(kv, c)
        b = kv.denoise_geometry(c)[3]  # the sliding layers' first canvas slot

        def forward(i: torch.Tensor, _) -> torch.Tensor:
            return self._fused_layers(self._embed_tokens(i), kv, causal=True)

        if self.use_graphs and self.device.type == "cuda":
            self._graph(kv, ("commit", c), forward, padded, None)(padded, None)
        else:
            forward(padded, None)
        for layer in self.layers:
            if layer.sliding:
                kv.write(layer.idx, start, kv.kv[layer.idx][:, :, b : b + t].clone())
        kv.length = start + t

    def _decode_layer(
        self, layer: Layer, h: torch.Tensor, kv: KVCache, positions: torch.Tensor
    ) -> torch.Tensor:
        """One decoder layer on the canvas stream h [C, hidden] at `positions`, attending to the cache."""
        if self._fused_for(kv, h.shape[0]):
            self._load_geometry(kv, h.shape[0])
            return self._decode_layer_fused(layer, h, kv, positions, {}, self._full_keys(kv, h.shape[0]))[0]
        fast = self.is_fast

        def attend(x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(layer, x, positions)
            if fast:
                keys, vals = kv.read_with(layer.idx, k, v)
                out = fast_ops.attention_nomask(q, keys, vals)
                return ops.rows(out)
            past_k, past_v, _ = kv.read(layer.idx)
            keys = torch.cat([past_k.to(k.dtype), k], dim=2)
            vals = torch.cat([past_v.to(v.dtype), v], dim=2)
            out = ops.attention(q, keys, vals, None)
            return ops.rows(out)

        return self._layer(layer, h, attend, layer.layer_scalar)

    def _decode_layer_fused(
        self,
        layer: Layer,
        h: torch.Tensor,
        kv: KVCache,
        positions: torch.Tensor,
        rope: dict,
        full_keys: int,
        x: torch.Tensor | None = None,
        next_norm: torch.Tensor | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_decode_layer's math as compiled regions (kernels/fused.py) around the library GEMMs and the attention
        kernels, with the cache length read on the device (`_load_geometry`), so that one CUDA graph serves
        every length whose full-layer keys fit `full_keys` (`_full_keys`).

        `rope`: the step's cos/sin tables by layer type (`_fused_qkv`); `x`: this layer's normed input when the
        previous layer made it; `next_norm`: the next layer's input_layernorm, applied in this layer's last
        region. `causal`: a commit's layer (`_commit`): causal attention and the encoder's layer scalar.
        Returns (h, the next layer's normed input)."""
        r, geo, c = self.fused_regions, self._geometry, h.shape[0]
        buf = kv.kv[layer.idx]  # [2, Hkv, slots, d]
        # K/V go straight to the cache's canvas slots, and attention reads the cached span with them: no gather
        q, _ = self._fused_qkv(layer, h, x, r, positions, rope, buf, geo[3:4] if layer.sliding else geo[0:1])
        if layer.sliding:  # the window before the canvas and the canvas: slots geo[1] .. geo[1] + geo[2]
            span = (geo[1:3], kv.denoise_key_slots(c))
            if causal:
                out = fast_ops.attention_commit(
                    q, buf[0:1], buf[1:2], span=span, window=self.cfg.sliding_window
                )
            else:
                out = fast_ops.attention_nomask(q, buf[0:1], buf[1:2], span=span)
        else:  # keys 0 .. length + c, of full_keys
            k, v = buf[0:1, :, :full_keys], buf[1:2, :, :full_keys]
            attend = fast_ops.attention_commit if causal else fast_ops.attention_nomask
            out = attend(q, k, v, valid=geo[4:5])
        scalar = layer.encoder_layer_scalar if causal else layer.layer_scalar
        return self._fused_ffn_half(layer, h, ops.rows(out), r, scalar, next_norm)
