"""The DiffusionGemma forward (seed Part II §2): one set of weights, two attention phases.

prefill(ids, caches)      causal encoder pass over new tokens; writes their K/V into each row's cache.
denoise(canvas, caches)   bidirectional decoder pass over canvases [B, C], each after its row's cache, which it
                          reads and never writes; returns logits [B, C, V].

Each layer runs as its steps (`self.steps`: `model.steps.Steps`, the torch reference, unless a runner sets
`FastSteps`); nothing here picks a backend, captures a graph or chunks a prompt.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffgemma.config import ModelConfig
from diffgemma.kernels import torch_ref as ops
from diffgemma.model.kv_cache import KVCache
from diffgemma.model.passes import Pass
from diffgemma.model.steps import Steps
from diffgemma.quant.weight import QuantWeight, dense

# Embedding rows widened to fp32 at a time by the exact soft embedding: 16,384 x 2,816 x 4 B = 184 MB at the real shape.
SC_VOCAB_CHUNK = 16384


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Layer(nn.Module):
    """One transformer layer. Parameter names follow the checkpoint (`model.decoder.layers.N.*`)."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        h, hd, nh, nkv = cfg.hidden_size, cfg.head_dims[idx], cfg.num_heads, cfg.num_kv_heads[idx]
        self.idx = idx
        self.layer_type = cfg.layer_types[idx]
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
        from the current parameters. Call it outside CUDA-graph capture first (the graph's warm-up does). While
        the parameters take gradients it is a plain (differentiable) concatenation instead."""
        parts = [getattr(self, n) for n in names]
        if any(isinstance(p, QuantWeight) for p in parts):
            return self._merged_quant(names, parts)
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return torch.cat(parts)
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

    def _merged_quant(self, names: tuple[str, ...], parts: list) -> QuantWeight | torch.Tensor:
        """`merged` for quantized weights: one QuantWeight of their concatenated tensors, the parts' tensors
        re-pointed into it; weights of different formats are dequantized and concatenated instead."""
        hit = self._merged.get(names)
        if hit is not None and hit[1] == [id(p) for p in parts]:
            return hit[0]
        if not all(isinstance(p, QuantWeight) for p in parts) or len({p.fmt for p in parts}) > 1:
            return torch.cat([dense(p, torch.float32) for p in parts]).to(self.q_norm.dtype)
        w = QuantWeight.cat(parts)
        row = 0
        for p in parts:
            for s in p.parts:
                p.parts[s] = w.parts[s][..., row : row + p.shape[-2], :]
            row += p.shape[-2]
        self._merged[names] = (w, [id(p) for p in parts])
        return w

    def qkv_weight(self, dtype: torch.dtype) -> torch.Tensor | QuantWeight:
        w = self.merged(*self.qkv_names)
        return w if isinstance(w, QuantWeight) else w.to(dtype)

    def gate_up_weight(self, dtype: torch.dtype) -> torch.Tensor | QuantWeight:
        w = self.merged("mlp_gate", "mlp_up")
        return w if isinstance(w, QuantWeight) else w.to(dtype)


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
        self.steps: Steps = Steps()  # the step implementations (`runner.ModelRunner` may set fast ones)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_cache(self, max_tokens: int = 4096, ring_size: int | None = None) -> KVCache:
        return KVCache(self.cfg, max_tokens, self.device, self.dtype, ring_size=ring_size)

    # -- the two phases ------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        ids: torch.Tensor,
        caches: KVCache | list[KVCache],
        compute_dtype: torch.dtype | None = None,
        valid: int | None = None,
    ) -> None:
        """Causally encode ids [B, T] at positions cache.length.. of each row's cache and extend the caches by T
        (by `valid` when only the first `valid` tokens of each row are real: the rest are pads, which no real
        token sees and which write nothing). No pre-layer norm on the encoder input (seed §2).

        `compute_dtype` (e.g. fp32 for short prompts, seed §3) runs the activations in it; the cache keeps its own."""
        caches = [caches] if isinstance(caches, KVCache) else caches
        ids = self.check_ids(ids, len(caches))
        n = ids.shape[1] if valid is None else valid
        for kv in caches:
            if kv.length + n > kv.max_tokens:
                raise ValueError(f"prompt does not fit: {kv.length} cached + {n} new > {kv.max_tokens}")
        dtype = compute_dtype or self.dtype
        p = Pass.prefill(caches, ids.shape[1], valid)
        self.layers_forward(self.embed_tokens(ids.reshape(-1)).to(dtype), p)
        for kv in caches:
            kv.length += n

    @torch.no_grad()
    def denoise(
        self,
        canvas_ids: torch.Tensor,
        caches: KVCache | list[KVCache],
        sc_logits: torch.Tensor | None = None,
        *,
        sc_probs: torch.Tensor | None = None,
        sc_seed: bool = False,
        sc_exact: bool = False,
        raw: bool = False,
        out: torch.Tensor | None = None,
        p: Pass | None = None,
    ) -> torch.Tensor:
        """Logits [B, C, V] (fp32, softcapped) for canvases [B, C], each placed after its row's cache.

        Self-conditioning: `sc_logits` as transformers' `self_conditioning_logits` (probs = their softmax), or
        `sc_probs` [B, C, V] (or [B*C, V]) already normalised, or `sc_seed` (the first-step seed: the canvas's own
        embedding), or none; `sc_exact`: the soft embedding of fp32 probabilities accumulated in fp32 (seed §5's exact
        path, `soft_embedding`). `raw`: the LM head's output before the final softcap, in the model's dtype (the
        sampler's row pass softcaps as it reads); `out` [B*C, V]: where to write it. `p`: the pass, when the
        caller holds its geometry on the device (a runner's CUDA graph)."""
        caches = [caches] if isinstance(caches, KVCache) else caches
        canvas = self.check_ids(canvas_ids, len(caches)).reshape(-1)
        c = canvas.shape[0] // len(caches)
        if sc_logits is not None:
            sc_probs = torch.softmax(sc_logits.reshape(canvas.shape[0], -1), dim=-1, dtype=torch.float32)
        if sc_probs is not None:
            sc_probs = sc_probs.reshape(canvas.shape[0], -1)
        p = p or Pass.denoise(caches, c)
        h = self.layers_forward(self.decoder_input(canvas, sc_probs, sc_seed, sc_exact), p)
        return self.logits(h, out=out, raw=raw).view(len(caches), c, -1)

    # -- the pieces, top to bottom -------------------------------------------------------------------------

    def check_ids(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """ids [B, T] (or [T] for one row) on the model's device, one row per cache, every id in the vocabulary."""
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != rows:
            raise ValueError(
                f"expected token ids shaped [{rows}, T] (one row a cache), got {tuple(ids.shape)}"
            )
        # Ids already on the GPU come from the sampler: checking them would cost a host sync every step.
        if (
            ids.numel()
            and ids.device.type != "cuda"
            and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size)
        ):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return ids.to(self.device)

    def embed_scale(self, dtype: torch.dtype) -> float:
        # transformers rounds sqrt(hidden) to the embedding dtype (55.43 -> 55.5 in bf16): mirror it.
        # A Python float (not a cpu tensor) so that a CUDA graph can capture the product.
        return float(torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=self.embed.dtype).to(dtype))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # F.embedding, not self.embed[ids]: the same rows, but its backward is a dense scatter-add where the
        # indexing backward sorts; that sort was 40% of the demo trainer's GPU time (measured on an H200).
        return F.embedding(ids, self.embed) * self.embed_scale(self.embed.dtype)

    def decoder_input(
        self, canvas: torch.Tensor, sc_probs: torch.Tensor | None, sc_seed: bool, sc_exact: bool = False
    ) -> torch.Tensor:
        """The canvas's token embeddings plus the SC MLP on the soft signal, then rms_norm_no_scale (seed §4.1):
        the soft signal is `soft_embedding(sc_probs)`, or with `sc_seed` the canvas's own embedding, or zero (whose
        SC MLP output is exactly zero)."""
        cfg = self.cfg
        emb = self.embed_tokens(canvas)
        if sc_probs is not None:
            soft = self.soft_embedding(sc_probs, sc_exact) * self.embed_scale(emb.dtype)
        elif sc_seed:
            soft = emb
        else:
            return ops.rms_norm(emb, None, cfg.rms_norm_eps)
        return self.self_conditioned(emb, soft)

    def decoder_input_runs(
        self, ids: torch.Tensor, sc: torch.Tensor | None, runs: list[tuple[int, int, str | None]], c: int
    ) -> torch.Tensor:
        """`decoder_input` of several canvases' rows at once: ids [N]; `runs`, (first row, end row, mode) in row
        order covering them, mode "probs" or "exact" (the soft embedding of sc [N, V]'s rows, exact or not),
        "seed" or None (no SC input). Each run is one `decoder_input` over its rows: row for row its arithmetic.
        The soft embedding runs a canvas (c rows) at a time, the GEMM of a lone canvas: its [c, V] x [V, H] shape
        (cuBLAS splits its long K) and its sums, whatever the batch."""
        emb = self.embed_tokens(ids)
        outs = []
        for a, b, mode in runs:
            if mode is None:
                outs.append(ops.rms_norm(emb[a:b], None, self.cfg.rms_norm_eps))
                continue
            soft = emb[a:b]
            if mode != "seed":
                parts = [self.soft_embedding(sc[r : r + c], mode == "exact") for r in range(a, b, c)]
                soft = (parts[0] if len(parts) == 1 else torch.cat(parts)) * self.embed_scale(emb.dtype)
            outs.append(self.self_conditioned(emb[a:b], soft))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def self_conditioned(self, emb: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        """The canvas's embeddings `emb` plus the SC MLP on the soft signal `soft`, then rms_norm_no_scale."""
        x = ops.rms_norm(soft, self.sc_pre_norm, self.cfg.rms_norm_eps)
        lin = self.steps.linear
        sc = lin(ops.gelu_tanh(lin(x, self.sc_gate)) * lin(x, self.sc_up), self.sc_down)
        return ops.rms_norm(emb + sc, None, self.cfg.rms_norm_eps)

    def soft_embedding(self, probs: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """probs [N, V] @ embed, in the embedding's dtype. By default one GEMM on the probabilities cast to that dtype
        (as transformers computes it). `exact` (the sampler's sc_sparse=False, seed §5): fp32 probabilities times
        the embedding widened to fp32 a vocabulary chunk at a time (`SC_VOCAB_CHUNK` rows, so no fp32 copy of the
        whole table), accumulated in fp32 and rounded once."""
        e = self.embed
        if not exact or e.dtype == torch.float32:
            return probs.to(e.dtype) @ e
        acc = torch.zeros(probs.shape[0], e.shape[1], device=e.device, dtype=torch.float32)
        probs = probs.float()
        for s in range(0, e.shape[0], SC_VOCAB_CHUNK):
            acc.addmm_(probs[:, s : s + SC_VOCAB_CHUNK], e[s : s + SC_VOCAB_CHUNK].float())
        return acc.to(e.dtype)

    def layers_forward(self, h: torch.Tensor, p: Pass) -> torch.Tensor:
        """The layers over the pass's token stream h [B*T, hidden]; each layer's last step also norms the next
        layer's input."""
        x = None
        for layer, nxt in zip(self.layers, [*self.layers[1:], None], strict=True):
            h, x = self.layer_forward(layer, h, x, p, None if nxt is None else nxt.input_layernorm)
        return h

    def layer_forward(
        self, layer: Layer, h: torch.Tensor, x: torch.Tensor | None, p: Pass, next_norm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer (seed §2.1): attention, then the dense MLP and the MoE side by side, seven norms in all.
        `x`: this layer's normed input when the layer before made it. Returns (h, the next layer's normed input
        when `next_norm` is given)."""
        k, eps, dt = self.steps, self.cfg.rms_norm_eps, h.dtype
        if x is None:
            x = k.norm(h, layer.input_layernorm, eps, p)
        # attention: q/k/v in one GEMM, the per-head norms and RoPE, the phase's attention, o_proj
        qkv = k.linear(x, layer.qkv_weight(dt))
        q, kv = k.qk_norm_rope(qkv, layer, self.inv_freq_for(layer, qkv.device), eps, p)
        attn = k.linear(k.attention(q, kv, layer, p, self.cfg.sliding_window), layer.o_proj)
        # the FFN half: residual, the three normed inputs, routing, the dense MLP beside the experts, the combine
        h, x_dense, x_moe, r = k.pre_ffn(h, attn, layer, eps, p)
        routing = k.route(r, layer, self.cfg.top_k_experts, p)
        dense = k.dense_mlp(x_dense, layer, eps, p)
        y = k.experts(x_moe, routing, layer, p)
        return k.post_ffn(h, dense, y, routing, layer, p.scalar(layer), next_norm, eps, p)

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        """The final norm and the LM head (the tied embedding): softcapped fp32 logits [N, V], or (raw) the head's
        output before the softcap in h's dtype, into `out` when given."""
        h = ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        head = (self.embed if self.lm_head is None else self.lm_head).to(h.dtype)
        logits = F.linear(h, head) if out is None else torch.mm(h, head.t(), out=out)
        return logits if raw else self.steps.softcap(logits, self.cfg.final_logit_softcapping)

    def inv_freq_for(self, layer: Layer, device: torch.device) -> torch.Tensor:
        # layer.layer_type, not cfg.layer_types[layer.idx]: a compiled layer would specialize on each index
        lt = layer.layer_type
        if self.inv_freq[lt].device != device:  # move once: a host copy cannot sit inside a CUDA graph
            self.inv_freq[lt] = self.inv_freq[lt].to(device)
        return self.inv_freq[lt]
