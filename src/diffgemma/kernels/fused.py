"""Fused regions of the denoise layer for the CUDA fast path: the small ops between the library kernels
(fp32 rms_norm casts and reductions, RoPE, residuals, routing, the MoE gather/scatter) written once in plain
PyTorch from `torch_ref`'s ops and handed to `torch.compile` (inductor), which fuses each region into a few
Triton kernels. GEMMs inside a region stay cuBLAS (inductor's extern kernels); the grouped expert GEMMs are
called between regions, eagerly.

Every region is pinned to its eager self (the same function, not compiled) by tests/gpu/test_kernels.py, and
`Fused` falls back to the eager function for good if compilation fails, so the fast path never breaks on it.
All regions are free of host syncs and data-dependent shapes: they are captured in the denoise CUDA graph.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from diffgemma.kernels import cuda
from diffgemma.kernels import torch_ref as ref

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


# -- the regions (plain PyTorch; `Fused` compiles them) ------------------------------------------------------


def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return ref.rms_norm(x, w, eps)


def qkv_post(
    q: torch.Tensor,
    k_raw: torch.Tensor,
    v: torch.Tensor | None,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
):
    """Q/K norms + RoPE, V's rms_norm_no_scale (V = k_raw on full layers), to [1, heads, T, d]."""
    cos, sin = ref.rope_cos_sin(inv_freq, positions, q.dtype)
    v = k_raw if v is None else v
    q = ref.apply_rope(ref.rms_norm(q, q_norm, eps), cos, sin)
    k = ref.apply_rope(ref.rms_norm(k_raw, k_norm, eps), cos, sin)
    v = ref.rms_norm(v, None, eps)
    return q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def pre_ffn(
    h: torch.Tensor,
    attn: torch.Tensor,
    w_post_attn: torch.Tensor,
    w_pre_ff: torch.Tensor,
    w_pre_ff2: torch.Tensor,
    w_post_ff1: torch.Tensor,
    mlp_gate: torch.Tensor,
    mlp_up: torch.Tensor,
    mlp_down: torch.Tensor,
    router_proj: torch.Tensor,
    router_scale: torch.Tensor,
    per_expert_scale: torch.Tensor,
    eps: float,
    top_k: int,
):
    """Attention residual, the dense MLP (normed), routing, and the expert-sorted gather of the MoE input.

    Returns h (after the attention residual), dense (post_feedforward_layernorm_1'd), x2 [N, H] (the experts'
    input), bounds (int32 [E + 1]: expert e owns sorted pairs bounds[e]:bounds[e+1]), perm (the stable sort
    of the flat (row, j) pairs by expert), weights [N, k] fp32."""
    h = h + ref.rms_norm(attn, w_post_attn, eps)
    x = ref.rms_norm(h, w_pre_ff, eps)
    dense = F.linear(ref.gelu_tanh(F.linear(x, mlp_gate)) * F.linear(x, mlp_up), mlp_down)
    dense = ref.rms_norm(dense, w_post_ff1, eps)
    weights, ids = ref.route(h, router_proj, router_scale, per_expert_scale, top_k, eps)
    x2 = ref.rms_norm(h, w_pre_ff2, eps)
    n_exp = router_proj.shape[0]
    flat = ids.reshape(-1)
    # A stable counting sort by expert on the one-hot [N*k, E] (small): counts without a host sync, and each
    # pair's slot = its expert's start + its rank among that expert's pairs. Same permutation as
    # torch.sort(flat, stable=True), whose radix sort took 29 us a layer on an H200, without the sort kernel.
    onehot = (flat[:, None] == torch.arange(n_exp, device=flat.device)[None, :]).to(torch.int32)
    counts = onehot.sum(0)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    rank = torch.cumsum(onehot, dim=0).gather(1, flat[:, None])[:, 0] - 1
    slot = (offs - counts)[flat] + rank
    perm = torch.empty_like(flat)
    perm[slot] = torch.arange(flat.shape[0], device=flat.device)
    bounds = F.pad(offs, (1, 0))
    return h, dense, x2, bounds, perm, weights


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    inter = gu.shape[-1] // 2
    return ref.gelu_tanh(gu[:, :inter]) * gu[:, inter:]


def post_ffn(
    h: torch.Tensor,
    dense: torch.Tensor,
    y: torch.Tensor,
    perm: torch.Tensor,
    weights: torch.Tensor,
    w_post_ff2: torch.Tensor,
    w_post_ff: torch.Tensor,
    scalar: torch.Tensor,
    eps: float,
    weighted: bool,
) -> torch.Tensor:
    """The weighted sum per row of the expert outputs (fp32), the last three norms, residual, layer scalar.

    y is the grouped GEMMs' output in sorted pair order, or (`weighted`) the Triton kernels' fp32 slots,
    already multiplied by the routing weights and in (row, j) order."""
    n, k = weights.shape
    if weighted:
        moe = y.view(n, k, -1).sum(1).to(h.dtype)
    else:
        unsorted = torch.empty_like(y)
        unsorted[perm] = y
        moe = (unsorted.view(n, k, -1).float() * weights.reshape(n, k, 1).float()).sum(1).to(h.dtype)
    moe = ref.rms_norm(moe, w_post_ff2, eps)
    h = h + ref.rms_norm(dense + moe, w_post_ff, eps)
    return h * scalar.to(h.dtype)


def moe_layer_ffn(h, attn, p: dict, eps: float, top_k: int, regions: dict) -> torch.Tensor:
    """The whole FFN half of a layer from the attention output: regions + the expert kernels (Triton where
    `cuda.triton_moe_for` allows, else the two grouped GEMMs)."""
    h, dense, x2, bounds, perm, weights = regions["pre_ffn"](
        h,
        attn,
        p["post_attention_layernorm"],
        p["pre_feedforward_layernorm"],
        p["pre_feedforward_layernorm_2"],
        p["post_feedforward_layernorm_1"],
        p["mlp_gate"],
        p["mlp_up"],
        p["mlp_down"],
        p["router_proj"],
        p["router_scale"],
        p["per_expert_scale"],
        eps,
        top_k,
    )
    gate_up, down = p["experts_gate_up"], p["experts_down"]
    y = None
    tm = cuda.triton_moe_for(x2, perm, gate_up)
    if tm is not None:
        try:
            cfg = tm.CONFIGS[tm.DEFAULT_CONFIG]
            act = tm.gate_up_act(x2, gate_up, perm, bounds, top_k, cfg.gate_up)
            y = tm.down_weighted(act, down, weights, perm, bounds, cfg.down)
        except Exception as e:  # noqa: BLE001 - any failure: the grouped GEMMs from then on, loudly
            cuda.triton_failed("triton_moe", e)
            y = None
    weighted = y is not None
    if y is None:
        offs = bounds[1:]
        gu = _grouped_mm(x2[perm // top_k], gate_up.transpose(1, 2), offs=offs)
        y = _grouped_mm(regions["gelu_mul"](gu), down.transpose(1, 2), offs=offs)
    return regions["post_ffn"](
        h,
        dense,
        y,
        perm,
        weights,
        p["post_feedforward_layernorm_2"],
        p["post_feedforward_layernorm"],
        p["layer_scalar"],
        eps,
        weighted,
    )


# -- compilation -------------------------------------------------------------------------------------------


class Fused:
    """`fn` compiled by inductor on first call (no dynamic shapes: a denoise step has fixed ones); if the
    compile fails, a message on stderr and the eager `fn` from then on. `compile_s` is the time of the calls
    that compiled (the first call per shape variant)."""

    def __init__(self, fn, mode: str | None = None, enabled: bool = True):
        self.fn = fn
        self.enabled = enabled
        self.mode = mode
        self.compiled = None
        self.failed: str | None = None
        self.compile_s = 0.0
        self._seen: set = set()

    def __call__(self, *args):
        if not self.enabled or self.failed:
            return self.fn(*args)
        if self.compiled is None:
            # emulate_precision_casts: round to bf16 wherever eager does, so the compiled region picks the
            # same top-k experts as the eager path (without it, fp32-kept intermediates flip a few choices).
            opts = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
            opts["emulate_precision_casts"] = True
            self.compiled = torch.compile(self.fn, dynamic=False, fullgraph=False, options=opts)
        sig = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        first = sig not in self._seen
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compile error: fall back to eager, loudly
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(
                f"diffgemma: torch.compile of {self.fn.__name__} failed ({self.failed}); eager",
                file=sys.stderr,
            )
            return self.fn(*args)
        if first:
            self._seen.add(sig)
            self.compile_s += time.perf_counter() - t0
        return out


def make_regions(enabled: bool = True, mode: str | None = None) -> dict:
    return {
        name: Fused(fn, mode=mode, enabled=enabled)
        for name, fn in (
            ("norm", norm),
            ("qkv_post", qkv_post),
            ("pre_ffn", pre_ffn),
            ("gelu_mul", gelu_mul),
            ("post_ffn", post_ffn),
        )
    }


def regions_report(regions: dict) -> dict:
    return {
        name: {"compile_s": round(r.compile_s, 2), "variants": len(r._seen), "failed": r.failed}
        for name, r in regions.items()
    }
