"""A layer's steps: what one layer's forward does between the kernels (reading the layer's weights by name,
writing the KV cache, filling in the `Pass`), as the torch reference (`Steps`, any device) and as the fast
steps (`FastSteps`: `kernels/`'s fast ops where they serve, asked through `kernels.dispatch`, else torch's
library kernels, with the small ops between them as `torch.compile`d regions). The model calls its steps
through one of these objects and never picks a backend itself; `runner.ModelRunner` picks one at construction.

Every fast step computes what its reference computes (tests pin them: fp32 on CPU bit for bit where the same
ops run, tests/gpu on the device). The fast steps prefill one row a pass; several canvases share a pass, their
attention run row by row, everything else over all of their rows at once.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from diffgemma.kernels import dispatch, library, regions
from diffgemma.kernels import torch_ref as ref
from diffgemma.model.passes import COMMIT, DENOISE, PREFILL, TRAIN, Pass
from diffgemma.quant.weight import QuantWeight, dense

# Rows up to which the router's GEMM runs inside the Triton top-k pass (docs/performance.md, "Routing and the
# FFN combine"): faster at a canvas's 256 rows, slower at a prefill chunk's 4,096; never for fp32 activations.
ROUTE_FROM_MAX_ROWS = 256
# Rows a program of the top-k pass in the batch-invariant mode, whatever the row count (`triton_route.route_sort`)
INVARIANT_ROUTE_ROWS = 8


class Routing(NamedTuple):
    """Each row's top-k experts and the (row, j) pairs sorted by expert (`torch_ref.sort_pairs`)."""

    weights: torch.Tensor  # [N, k] fp32
    ids: torch.Tensor  # [N, k]
    bounds: torch.Tensor  # int32 [E + 1]: expert e owns sorted pairs bounds[e]:bounds[e + 1]
    perm: torch.Tensor  # [N * k]: each sorted pair's flat (row, j) index
    slot: torch.Tensor  # [N * k]: its inverse


def _split_qkv(qkv: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The merged q/k/v GEMM's output [N, ...] as q [N, H, d], the raw K [N, Hkv, d] and V [N, Hkv, d] (None on a
    full layer, whose V is the raw K)."""
    n, hd, nq, nkv = qkv.shape[0], layer.head_dim, layer.n_heads, layer.n_kv
    q = qkv[:, : nq * hd].view(n, nq, hd)
    k_raw = qkv[:, nq * hd : (nq + nkv) * hd].view(n, nkv, hd)
    v = qkv[:, (nq + nkv) * hd :].view(n, nkv, hd) if layer.sliding else None
    return q, k_raw, v


def _heads(z: torch.Tensor, b: int) -> torch.Tensor:
    """[B * T, heads, d] -> [B, heads, T, d]."""
    return z.view(b, z.shape[0] // b, z.shape[1], z.shape[2]).transpose(1, 2)


class Steps:
    """The reference steps: plain torch ops (`torch_ref` and the uncompiled `regions`), any batch, any device."""

    fast = False

    def __init__(self, experts: str = "sorted", topk: bool = False) -> None:
        # "sorted": each expert over its own pairs (a host read of the bounds); "dense": every expert on every row,
        # zero-weighted where unrouted, without a host read (the trainer's, under CUDA graphs)
        if experts not in ("sorted", "dense"):
            raise ValueError(f"experts must be 'sorted' or 'dense', not {experts!r}")
        self.experts_mode = experts
        self.topk = topk  # the full layers' top-k sparse attention (`torch_ref.attention_topk`)

    def _attend(self, q, keys, vals, mask, layer) -> torch.Tensor:
        """A row's attention over its keys: top-k sparse on a full layer when `topk`, else dense."""
        if self.topk and not layer.sliding:
            return ref.attention_topk(q, keys, vals, mask, ref.topk_keys(keys.shape[2]))
        return ref.attention(q, keys, vals, mask)

    def linear(self, x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
        """x @ w.T in x's dtype; a quantized w dequantized first (the reference for every format)."""
        return F.linear(x, dense(w, x.dtype))

    def soft_embedding(self, probs: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """The SC soft embedding probs [N, V] @ embed [V, H] in embed's dtype: one GEMM on the probabilities cast
        to it (as transformers computes it)."""
        return probs.to(embed.dtype) @ embed

    # -- attention half -----------------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, p: Pass) -> torch.Tensor:
        return ref.rms_norm(x, w, eps)

    def qk_norm_rope(self, qkv: torch.Tensor, layer, inv_freq: torch.Tensor, eps: float, p: Pass):
        """The merged q/k/v GEMM's output [B*T, ...] -> q [B, H, T, d] and K/V stacked [2, B, Hkv, T, d]: the
        per-head Q/K norms, RoPE, and V's rms_norm_no_scale (V = the raw K on full layers)."""
        q, k_raw, v = _split_qkv(qkv, layer)
        v = k_raw if v is None else v
        cos, sin = p.cos_sin("sliding" if layer.sliding else "full", inv_freq, qkv.dtype)
        q = ref.apply_rope(ref.rms_norm(q, layer.q_norm, eps), cos, sin)
        k = ref.apply_rope(ref.rms_norm(k_raw, layer.k_norm, eps), cos, sin)
        v = ref.rms_norm(v, None, eps)
        b = p.batch
        return _heads(q, b), torch.stack([_heads(k, b), _heads(v, b)])

    def attention(self, q: torch.Tensor, kv: torch.Tensor, layer, p: Pass, window: int) -> torch.Tensor:
        """The pass's attention, as o_proj's input rows [B*T, H*d]; writes a prefill chunk's K/V to the cache.
        Scale 1 (the Q/K norms fold it)."""
        if p.phase == TRAIN:
            out = ref.attention(q, kv[0], kv[1], p.masks[layer.sliding])
            return out.transpose(1, 2).reshape(q.shape[0] * q.shape[2], -1)
        rows = []
        for b, cache in enumerate(p.caches):
            qb, k, v = q[b : b + 1], kv[0, b : b + 1], kv[1, b : b + 1]
            if p.phase == DENOISE:  # the canvas goes to the slots after the cached span, read with it
                keys, vals = cache.read_with(layer.idx, k, v)
                rows.append(ref.rows(self._attend(qb, keys, vals, None, layer)))
                continue
            if p.phase != PREFILL:
                raise ValueError(f"the reference kernels have no {p.phase!r} pass")
            start, t = p.starts[b], p.t
            past_k, past_v, past_pos = cache.read(layer.idx, start)
            keys = torch.cat([past_k.to(k.dtype), k], dim=2)
            vals = torch.cat([past_v.to(v.dtype), v], dim=2)
            positions = p.positions[b * t : (b + 1) * t]
            key_pos = torch.cat([past_pos, positions])
            mask = key_pos[None, :] <= positions[:, None]
            if layer.sliding:
                mask &= key_pos[None, :] > positions[:, None] - window
            cache.write(layer.idx, start, torch.cat([k, v])[:, :, : p.valid or t])
            rows.append(ref.rows(self._attend(qb, keys, vals, mask, layer)))
        return torch.cat(rows)

    # -- FFN half ----------------------------------------------------------------------------------------

    def pre_ffn(self, h: torch.Tensor, attn: torch.Tensor, layer, eps: float, p: Pass):
        """The attention residual and the FFN's inputs: (h, the dense MLP's normed input, the experts', the
        router's)."""
        dt = h.dtype
        return regions.pre_ffn(
            h,
            attn,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.pre_feedforward_layernorm_2,
            layer.router_scale.to(dt),
            eps,
        )

    def route(self, r: torch.Tensor, layer, top_k: int, p: Pass) -> Routing:
        weights, ids = ref.route_weights(
            F.linear(r, layer.router_proj.to(r.dtype)), layer.per_expert_scale, top_k
        )
        return Routing(weights, ids, *ref.sort_pairs(ids, layer.router_proj.shape[0]))

    def dense_mlp(self, x: torch.Tensor, layer, eps: float, p: Pass) -> torch.Tensor:
        dt = x.dtype
        gate_up = layer.gate_up_weight(dt)
        if isinstance(gate_up, QuantWeight) or isinstance(layer.mlp_down, QuantWeight):
            return self._dense_mlp_linear(x, gate_up, layer, eps)
        return regions.dense_mlp(x, gate_up, layer.mlp_down.to(dt), layer.post_feedforward_layernorm_1, eps)

    def _dense_mlp_linear(self, x, gate_up, layer, eps: float) -> torch.Tensor:
        """`regions.dense_mlp` through `linear`: quantized weights."""
        act = regions.gelu_mul(self.linear(x, gate_up))
        return ref.rms_norm(self.linear(act, layer.mlp_down), layer.post_feedforward_layernorm_1, eps)

    def experts(self, x: torch.Tensor, routing: Routing, layer, p: Pass) -> torch.Tensor:
        """Each (row, expert) pair's expert output [N*k, H], in sorted pair order, unweighted."""
        k = routing.weights.shape[1]
        if self.experts_mode == "dense":
            return _experts_dense(x, routing, k, layer.experts_gate_up, layer.experts_down)
        return ref.experts_sorted(
            x, routing.perm, routing.bounds, k, layer.experts_gate_up, layer.experts_down
        )

    def post_ffn(self, h, dense, y, routing: Routing, layer, scalar, next_norm, eps: float, p: Pass):
        """The experts' weighted sum, the last three norms, the residual and the layer scalar; with `next_norm`
        the next layer's normed input too. Returns (h, that input or None)."""
        return regions.post_ffn(
            h,
            dense,
            y,
            routing.slot,
            routing.weights,
            layer.post_feedforward_layernorm_2,
            layer.post_feedforward_layernorm,
            scalar,
            next_norm,
            eps,
        )

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        return ref.softcap(logits, cap)

    def lm_head(
        self,
        h: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        head: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm and the LM head: its raw output [N, V] in h's dtype (before the softcap), into `out`
        when given."""
        return self._head_gemm(ref.rms_norm(h, norm, eps), head, out)

    @staticmethod
    def _head_gemm(x: torch.Tensor, head: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """x [N, H] @ head.T [H, V], into `out` when given."""
        return F.linear(x, head) if out is None else torch.mm(x, head.t(), out=out)


def _experts_dense(x, routing: Routing, k: int, gate_up, down) -> torch.Tensor:
    """`torch_ref.experts_sorted` as every expert on every row, each pair's output picked from them: the same
    values without a host read (autograd and CUDA graphs)."""
    gate, up = torch.einsum("nh,efh->nef", x, dense(gate_up, x.dtype)).chunk(2, dim=-1)
    out = torch.einsum("nei,ehi->neh", ref.gelu_tanh(gate) * up, dense(down, x.dtype))  # [N, E, H]
    return out[routing.perm // k, routing.ids.reshape(-1)[routing.perm]]


class FastSteps(Steps):
    """The fast steps for one row: Triton kernels where they serve, library kernels, compiled regions, K/V
    written straight to the cache's slots and the cache geometry read on the device (`Pass.geometry`), so that
    a step can be captured in a CUDA graph. Activations in fp32 on 16-bit weights (a short prompt's prefill,
    seed rule 7) run the reference steps except attention and the experts."""

    fast = True

    def __init__(
        self, compile: bool = True, topk: bool = False, sc_gather: bool = False, invariant: bool = False
    ) -> None:
        super().__init__(topk=topk)
        self.sc_gather = sc_gather  # the SC soft embedding's survivor gather (`RuntimeConfig.sc_gather`)
        self.regions = regions.make_regions(enabled=compile)  # fixed shapes: the denoise step
        self.prefill_regions = regions.make_regions(enabled=compile, dynamic=True)  # any token count
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        # the batch-invariant mode (`RuntimeConfig.batch_invariant`): a row's sums in an order that does not
        # depend on the other rows of its pass (docs/performance.md, "Batch-invariant mode")
        self.invariant = invariant

    def _r(self, p: Pass) -> dict:
        """The regions for this pass: fixed shapes for a lone canvas, any row count for a prefill chunk or several
        canvases (a batch of each size would otherwise be a compile of its own). The batch-invariant mode takes
        the latter for every pass: one compiled kernel a region, whose row reductions do not change with N."""
        if self.invariant or p.phase == PREFILL or p.batch > 1:
            return self.prefill_regions
        return self.regions

    def _gemm(self, x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """x @ w.T by `triton_gemm` (fixed tiles, no split-K) in the batch-invariant mode, for 16-bit x on a
        plain weight of its dtype; None elsewhere (the caller's own GEMM serves)."""
        if not self.invariant or isinstance(w, QuantWeight) or w.dtype != x.dtype:
            return None
        fits = x.dtype in (torch.bfloat16, torch.float16)
        return dispatch.attempt("triton_gemm", lambda m: m.linear(x, w, out=out), x, fits=fits)

    @staticmethod
    def _geometry(p: Pass) -> torch.Tensor:
        """The pass's cache geometry on the device, [B, 5]: the runner's buffer (what its CUDA graph reads), else made
        here from the rows' caches, with the exact key counts."""
        if p.geometry is None:
            geo = [kv.denoise_geometry(p.t) for kv in p.caches]
            p.geometry = torch.tensor(geo, dtype=torch.int32, device=p.caches[0].device)
            p.full_keys = [kv.length + p.t for kv in p.caches]
        return p.geometry

    def linear(self, x, w):
        """fp8 weights on CUDA through `library.linear_fp8` (fp8 activations, per row); in the batch-invariant
        mode 16-bit weights through `triton_gemm`; the reference else."""
        if isinstance(w, QuantWeight) and w.fmt == "fp8" and x.is_cuda and x.dtype == torch.bfloat16:
            return library.linear_fp8(x, w)
        y = self._gemm(x, w)
        return y if y is not None else super().linear(x, w)

    def soft_embedding(self, probs, embed):
        """With `sc_gather`, the survivor gather on CUDA (`library.soft_embedding`): the reference's GEMM up to
        summation order; else the GEMM."""
        return (
            library.soft_embedding(probs, embed) if self.sc_gather else super().soft_embedding(probs, embed)
        )

    # -- attention half -----------------------------------------------------------------------------------

    def norm(self, x, w, eps, p: Pass):
        if dispatch.wide(x, w):
            return super().norm(x, w, eps, p)
        return self._r(p)["norm"](x, w, eps)

    def qk_norm_rope(self, qkv, layer, inv_freq, eps, p: Pass):
        """Q [B, H, T, d], and the K/V: written straight into each row's cache at its canvas slots on a denoise or
        commit pass (`kv_slot` read on the device; the layer's cache buffer is returned for one row, None for
        several), returned stacked [2, Hkv, T, d] on a prefill pass (one row; attention writes it). Several
        canvases run one by one here and in `attention`, each exactly as it would alone."""
        b, t = p.batch, p.t
        if b != 1 and p.phase == PREFILL:
            raise NotImplementedError(
                "the fast kernels prefill one row a pass; batched rows take the reference"
            )
        if dispatch.wide(qkv, layer.q_norm):
            if b != 1:
                raise NotImplementedError("fp32 activations on the fast kernels take one row a pass")
            q, kv = super().qk_norm_rope(qkv, layer, inv_freq, eps, p)
            return q, kv[:, 0]
        cos, sin = p.cos_sin("sliding" if layer.sliding else "full", inv_freq, qkv.dtype)
        rows = [slice(i * t, (i + 1) * t) for i in range(b)]
        outs = [
            self._qk_row(qkv[r], layer, inv_freq, cos[r], sin[r], p.positions[r], eps, p, i)
            for i, r in enumerate(rows)
        ]
        if b == 1:
            return outs[0]
        return torch.cat([q for q, _ in outs]), None

    def _qk_row(self, qkv, layer, inv_freq, cos, sin, positions, eps, p: Pass, row: int):
        """`qk_norm_rope` of one row's T tokens."""
        t, hd, nq, nkv = qkv.shape[0], layer.head_dim, layer.n_heads, layer.n_kv
        kv_out = kv_slot = None
        if p.phase in (DENOISE, COMMIT):
            kv_out = p.caches[row].kv[layer.idx]
            geo = self._geometry(p)[row]
            kv_slot = geo[3:4] if layer.sliding else geo[0:1]
        out = dispatch.attempt(
            "triton_qkv",
            lambda m: m.norm_rope(
                qkv, nq, nkv, layer.sliding, cos, sin, layer.q_norm, layer.k_norm, eps, kv_out, kv_slot
            ),
            qkv,
            fits=hd >= 2 and hd & (hd - 1) == 0,  # a power-of-two head_dim
        )
        if out is not None:
            return out
        q, k_raw, v = _split_qkv(qkv, layer)
        q, kv_new = self._r(p)["qkv_post"](
            q, k_raw, v, layer.q_norm, layer.k_norm, inv_freq, positions, eps, True
        )
        if kv_slot is not None:
            kv_out.index_copy_(2, kv_slot.long() + torch.arange(t, device=kv_slot.device), kv_new)
            return q, kv_out
        return q, kv_new

    def attention(self, q, kv, layer, p: Pass, window: int):
        if p.phase == PREFILL:
            return self._prefill_attention(q, kv, layer, p.caches[0], p, window)
        outs = [self._canvas_attention(q[i : i + 1], layer, p, i, window) for i in range(p.batch)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _canvas_attention(self, q, layer, p: Pass, row: int, window: int) -> torch.Tensor:
        """One row's canvas over its cache (denoise: unmasked; commit: causal), as o_proj's rows [T, H*d]."""
        cache, geo, c = p.caches[row], self._geometry(p)[row], q.shape[2]
        buf = cache.kv[layer.idx]  # the canvas's K/V already sit in its canvas slots (`qk_norm_rope`)
        causal = p.phase == COMMIT
        if layer.sliding:  # the window before the canvas and the canvas: slots geo[1] .. geo[1] + geo[2]
            span = (geo[1:3], cache.denoise_key_slots(c))
            if causal:
                out = library.attention_commit(q, buf[0:1], buf[1:2], span=span, window=window)
            else:
                out = library.attention_nomask(q, buf[0:1], buf[1:2], span=span)
        else:  # keys 0 .. length + c, of full_keys
            n = p.full_keys[row]
            k, v = buf[0:1, :, :n], buf[1:2, :, :n]
            attend = library.attention_commit if causal else library.attention_nomask
            out = attend(q, k, v, valid=geo[4:5], topk=self.topk)
        return ref.rows(out)

    def _prefill_attention(self, q, chunk, layer, cache, p: Pass, window: int) -> torch.Tensor:
        """A prefill chunk's causal attention over the cached past and itself, as rows [T, H*d]; writes the
        chunk's K/V. A sliding layer's window is copied into the attention's buffer before the write may
        overwrite it. The sliding layers share one mask (`library.window_bias`): they see the same positions."""
        start, t = p.starts[0], p.t
        if layer.sliding:
            if p.window_bias is None:
                gqa = layer.n_heads // layer.n_kv
                p.window_bias = library.window_bias(min(start, window - 1), t, window, gqa, q.dtype, q.device)
            out = library.attention_window(q, cache.span(layer.idx, start).to(q.dtype), chunk, p.window_bias)
            cache.write(layer.idx, start, chunk)
            return out
        cache.write(layer.idx, start, chunk)
        if chunk.dtype == cache.dtype:  # the past, then the chunk just written: one view of the cache
            both = cache.span(layer.idx, start + t)
        else:
            both = torch.cat([cache.span(layer.idx, start).to(chunk.dtype), chunk], dim=2)
        return library.attention_causal_past(q, both[0:1], both[1:2], topk=self.topk)

    # -- FFN half ----------------------------------------------------------------------------------------

    def pre_ffn(self, h, attn, layer, eps, p: Pass):
        if dispatch.wide(h, layer.router_scale):
            return super().pre_ffn(h, attn, layer, eps, p)
        return self._r(p)["pre_ffn"](
            h,
            attn,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.pre_feedforward_layernorm_2,
            layer.router_scale,
            eps,
        )

    def route(self, r, layer, top_k, p: Pass) -> Routing:
        """The Triton top-k and sort (on 16-bit activations of up to ROUTE_FROM_MAX_ROWS rows with the router's
        GEMM inside), else the library GEMM and the compiled region."""
        if dispatch.wide(r, layer.router_proj):
            return super().route(r, layer, top_k, p)
        proj, scale = layer.router_proj, layer.per_expert_scale
        logits = self._gemm(r, proj)  # the batch-invariant mode: its GEMM, then the top-k on fixed row blocks

        def triton_route(m):
            if logits is not None:
                return m.route_sort(logits, scale, top_k, rows=INVARIANT_ROUTE_ROWS)
            if r.shape[0] > ROUTE_FROM_MAX_ROWS:
                return m.route_sort(F.linear(r, proj), scale, top_k)
            return m.route_sort_from(r, proj, scale, top_k)

        out = dispatch.attempt("triton_route", triton_route, r)
        if out is not None:
            return Routing(*out)
        logits = F.linear(r, proj) if logits is None else logits
        weights, bounds, perm, slot = self._r(p)["route"](logits, scale, top_k)
        return Routing(weights, None, bounds, perm, slot)

    def dense_mlp(self, x, layer, eps, p: Pass):
        """The dense MLP on a second stream on CUDA (it does not depend on the routing): it runs beside the
        experts, and `post_ffn` joins it."""
        if dispatch.wide(x, layer.mlp_down):
            return super().dense_mlp(x, layer, eps, p)
        side = self._side_stream(x)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        gate_up = layer.gate_up_weight(x.dtype)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if isinstance(gate_up, QuantWeight) or isinstance(layer.mlp_down, QuantWeight):
                return self._dense_mlp_linear(x, gate_up, layer, eps)
            if self.invariant:  # the region's two GEMMs as `triton_gemm`'s, around its gelu * up and norm
                r = self._r(p)
                act = r["gelu_mul"](self.linear(x, gate_up))
                return r["norm"](self.linear(act, layer.mlp_down), layer.post_feedforward_layernorm_1, eps)
            return self._r(p)["dense_mlp"](
                x, gate_up, layer.mlp_down, layer.post_feedforward_layernorm_1, eps
            )

    def experts(self, x, routing: Routing, layer, p: Pass) -> torch.Tensor:
        """int4 experts at a denoise step on `gluon_moe` (not in the batch-invariant mode, whose tiles are fixed);
        else the Triton expert kernels up to library.TRITON_MAX_PAIRS_PER_EXPERT pairs an expert, else two
        grouped GEMMs around the compiled gelu*up."""
        gate_up, down, perm, bounds = layer.experts_gate_up, layer.experts_down, routing.perm, routing.bounds
        top_k = routing.weights.shape[1]
        if not self.invariant:
            y = library.experts_sorted_gluon(x, perm, bounds, top_k, gate_up, down)
            if y is not None:
                return y
        if library.triton_moe_for(x, perm.numel(), gate_up, fixed=self.invariant) is not None:

            def kernels(m):
                cfg = m.config_for_weights(perm.numel(), x, gate_up, fixed=self.invariant)
                return m.down_sorted(
                    m.gate_up_act(x, gate_up, perm, bounds, top_k, cfg.gate_up), down, bounds, cfg.down
                )

            y = dispatch.attempt("triton_moe", kernels, x)
            if y is not None:
                return y
        gelu_mul = regions.gelu_mul if dispatch.wide(x, gate_up) else self._r(p)["gelu_mul"]
        return library.experts_grouped(x, perm, bounds[1:], top_k, gate_up, down, gelu_mul)

    def post_ffn(self, h, dense, y, routing: Routing, layer, scalar, next_norm, eps, p: Pass):
        """Joins the dense MLP's stream, then one Triton kernel where it serves, else the compiled region."""
        side = self._side.get(h.device)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if dispatch.wide(h, layer.post_feedforward_layernorm):
            return super().post_ffn(h, dense, y, routing, layer, scalar, next_norm, eps, p)
        args = (
            h,
            dense,
            y,
            routing.slot,
            routing.weights,
            layer.post_feedforward_layernorm_2,
            layer.post_feedforward_layernorm,
            scalar.to(h.dtype),
            next_norm,
            eps,
        )
        out = dispatch.attempt("triton_combine", lambda m: m.post_ffn(*args), h)
        return out if out is not None else self._r(p)["post_ffn"](*args)

    def softcap(self, logits, cap):
        return self.regions["softcap"](logits, cap)

    def lm_head(self, h, norm, eps, head, out=None):
        """In the batch-invariant mode the norm's compiled region of any row count and `triton_gemm`; else the
        reference's."""
        if not self.invariant or dispatch.wide(h, head):
            return super().lm_head(h, norm, eps, head, out)
        x = self.prefill_regions["norm"](h, norm, eps)
        y = self._gemm(x, head, out)
        return y if y is not None else self._head_gemm(x, head, out)

    def _side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        """The second stream of x's CUDA device (None elsewhere). A CUDA graph captures the work queued on it
        as a branch that runs concurrently with the capturing stream's."""
        if not x.is_cuda:
            return None
        if x.device not in self._side:
            self._side[x.device] = torch.cuda.Stream(x.device)
        return self._side[x.device]
