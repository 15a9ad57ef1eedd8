"""The regions of a layer between its library kernels (fp32 rms_norm casts and reductions, RoPE, residuals,
routing, the experts' combine), written once in plain PyTorch from `torch_ref`'s ops. The reference kernels run
them as they are; the fast kernels hand them to `torch.compile` (inductor), which fuses each region into a few
Triton kernels (GEMMs inside a region stay cuBLAS, inductor's extern kernels).

Every region is pinned to its eager self by tests/gpu/test_kernels.py, and `Fused` falls back to the eager
function for good if compilation fails, so the fast path never breaks on it. All regions are free of host syncs
and data-dependent shapes: they are captured in the denoise CUDA graph. The prefill runs the same functions from
a second set of `Fused`, compiled with a symbolic token count.
"""

from __future__ import annotations

import inspect
import sys
import time

import torch
import torch.nn.functional as F

from diffgemma.kernels import torch_ref as ref

_HAS_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters  # newer torch


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
    stacked: bool = False,
):
    """Q/K norms + RoPE, V's rms_norm_no_scale (V = k_raw on full layers), to [1, heads, T, d].

    Q comes out contiguous, so that attention's GQA reshape is a view. `stacked`: K and V as one contiguous
    [2, kv_heads, T, d] (the cache stores it with one copy) in place of two. q, k_raw and v may be strided
    views of one [T, (heads + 2 kv_heads) * d] GEMM output."""
    cos, sin = ref.rope_cos_sin(inv_freq, positions, q.dtype)
    v = k_raw if v is None else v
    q = ref.apply_rope(ref.rms_norm(q, q_norm, eps), cos, sin)
    k = ref.apply_rope(ref.rms_norm(k_raw, k_norm, eps), cos, sin)
    v = ref.rms_norm(v, None, eps)
    q = q.transpose(0, 1).contiguous()[None]
    if stacked:
        return q, torch.stack([k.transpose(0, 1), v.transpose(0, 1)])
    return q, k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    # one pass over the [C, vocab] logits; eager is four (fp32 cast, divide, tanh, multiply: 0.5 ms at C=256)
    return ref.softcap(logits, cap)


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    inter = gu.shape[-1] // 2
    return ref.gelu_tanh(gu[:, :inter]) * gu[:, inter:]


def pre_ffn(
    h: torch.Tensor,
    attn: torch.Tensor,
    w_post_attn: torch.Tensor,
    w_pre_ff: torch.Tensor,
    w_pre_ff2: torch.Tensor,
    router_scale: torch.Tensor,
    eps: float,
):
    """Attention residual and the FFN's inputs: (h after the residual, x the dense MLP's normed input, x2
    [N, H] the experts' input, r [N, H] the router's: its logits are F.linear(r, router_proj), in `_route`)."""
    h = h + ref.rms_norm(attn, w_post_attn, eps)
    x = ref.rms_norm(h, w_pre_ff, eps)
    r = ref.router_input(h, router_scale, eps)
    x2 = ref.rms_norm(h, w_pre_ff2, eps)
    return h, x, x2, r


def route(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int):
    """The routing weights [N, k] fp32 and the expert-sorted order of the (row, j) pairs: (weights, bounds
    (int32 [E + 1]: expert e owns sorted pairs bounds[e]:bounds[e+1]), perm (the stable sort of the flat pairs
    by expert), slot (its inverse: pair i's sorted position)). `triton_route.route_sort` is its one-kernel twin."""
    weights, ids = ref.route_weights(logits, per_expert_scale, top_k)
    # the counting sort: torch.sort(flat, stable=True)'s radix sort took 29 us a layer on an H200
    bounds, perm, slot = ref.sort_pairs(ids, logits.shape[1])
    return weights, bounds, perm, slot


def dense_mlp(
    x: torch.Tensor, mlp_gate_up: torch.Tensor, mlp_down: torch.Tensor, w_post_ff1: torch.Tensor, eps: float
) -> torch.Tensor:
    """The dense MLP on its normed input (gate and up as one GEMM on [gate; up]), post_feedforward_layernorm_1'd."""
    return ref.rms_norm(F.linear(gelu_mul(F.linear(x, mlp_gate_up)), mlp_down), w_post_ff1, eps)


def post_ffn(
    h: torch.Tensor,
    dense: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    weights: torch.Tensor,
    w_post_ff2: torch.Tensor,
    w_post_ff: torch.Tensor,
    scalar: torch.Tensor,
    w_next: torch.Tensor | None,
    eps: float,
):
    """The weighted sum per row of the expert outputs (fp32), the last three norms, residual, layer scalar;
    and with `w_next` (the next layer's input_layernorm) that layer's normed input too, in the same kernels.

    y is the experts' output in sorted pair order (pair (row, j) at slot[row * k + j]), from the grouped GEMMs
    or the Triton kernels alike. Returns (h, normed input or None)."""
    n, k = weights.shape
    # The k terms summed one by one: a pointwise kernel over [N, H] whose loads run along H. As a sum over
    # dim 1 of [N, k, H], inductor made a reduction that took 0.36 ms a layer for a 4,096-token prefill chunk,
    # 8x its read, after a 0.17 ms scatter (index_put) back to (row, j) order that the gather by slot replaces.
    rows = slot.view(n, k)
    terms = [y[rows[:, j]].float() * weights[:, j : j + 1].float() for j in range(k)]
    moe = terms[0]
    for term in terms[1:]:
        moe = moe + term
    moe = ref.rms_norm(moe.to(h.dtype), w_post_ff2, eps)
    h = h + ref.rms_norm(dense + moe, w_post_ff, eps)
    h = h * scalar.to(h.dtype)
    return h, None if w_next is None else ref.rms_norm(h, w_next, eps)


# -- compilation -------------------------------------------------------------------------------------------


class Fused:
    """`fn` compiled by inductor on first call; if the compile fails, a message on stderr and the eager `fn`
    from then on. `compile_s` is the time of the calls that compiled (the first call per shape variant).

    Shapes are static (a denoise step has fixed ones), except dim 0 of the args named in `dynamic`: those are
    compiled symbolic (a prefill chunk's token count varies with the prompt, and a compile per new length
    would cost seconds). Sizes 0 and 1 stay specialized (dynamo's rule), so a 1-token chunk is one variant more.
    """

    def __init__(self, fn, mode: str | None = None, enabled: bool = True, dynamic: tuple[str, ...] = ()):
        self.fn = fn
        self.enabled = enabled
        self.mode = mode
        names = list(inspect.signature(fn).parameters)
        if unknown := set(dynamic) - set(names):
            raise ValueError(f"{fn.__name__} has no parameters {sorted(unknown)}")
        self.dynamic = tuple(names.index(n) for n in dynamic)  # their positions
        self.compiled = None
        self.failed: str | None = None
        self.compile_s = 0.0
        self._seen: set = set()

    def _signature(self, args) -> tuple:
        """What a compiled variant is keyed on: dtypes, static shapes, non-tensor args."""
        sig = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                sig.append(a)
                continue
            shape = list(a.shape)
            if i in self.dynamic and shape[0] > 1:
                shape[0] = "n"
            sig.append((tuple(shape), a.dtype))
        return tuple(sig)

    def __call__(self, *args):
        if not self.enabled or self.failed:
            return self.fn(*args)
        if self.compiled is None:
            # emulate_precision_casts: round to bf16 wherever eager does, so the compiled region picks the
            # same top-k experts as the eager path (without it, fp32-kept intermediates flip a few choices).
            opts = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
            opts["emulate_precision_casts"] = True
            # dynamic=False turns off automatic dynamic shapes (a second head_dim would make the head dims
            # symbolic); the dims marked below are symbolic all the same. Dynamo keys compiled entries on the
            # function and an equal backend, so without isolate_recompiles the denoise step would reuse the
            # prefill's symbolic-shape kernels; isolated, the prefill may still reuse the denoise's.
            kw = {"isolate_recompiles": True} if self.dynamic and _HAS_ISOLATE else {}
            self.compiled = torch.compile(self.fn, dynamic=False, fullgraph=False, options=opts, **kw)
        for i in self.dynamic:
            if isinstance(args[i], torch.Tensor) and args[i].shape[0] > 1:
                torch._dynamo.mark_dynamic(args[i], 0)
        sig = self._signature(args)
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


# Per region, the parameters whose dim 0 is the token count (or the token-expert pair count): symbolic in the
# prefill regions (`make_regions(dynamic=True)`).
TOKEN_ARGS: dict[str, tuple[str, ...]] = {
    "norm": ("x",),
    "qkv_post": ("q", "k_raw", "v", "positions"),
    "pre_ffn": ("h", "attn"),
    "route": ("logits",),
    "dense_mlp": ("x",),
    "gelu_mul": ("gu",),
    "post_ffn": ("h", "dense", "y", "slot", "weights"),
}


def make_regions(enabled: bool = True, mode: str | None = None, dynamic: bool = False) -> dict:
    """The regions, compiled for fixed shapes (the denoise step) or, `dynamic`, for any token count (the
    prefill chunks, which have no logits: no softcap region)."""
    fns = [("norm", norm), ("qkv_post", qkv_post), ("pre_ffn", pre_ffn), ("route", route)]
    fns += [("dense_mlp", dense_mlp)]
    fns += [("gelu_mul", gelu_mul)]
    fns += [("post_ffn", post_ffn)] + ([] if dynamic else [("softcap", softcap)])
    return {
        name: Fused(fn, mode=mode, enabled=enabled, dynamic=TOKEN_ARGS[name] if dynamic else ())
        for name, fn in fns
    }


def regions_report(regions: dict) -> dict:
    return {
        name: {"compile_s": round(r.compile_s, 2), "variants": len(r._seen), "failed": r.failed}
        for name, r in regions.items()
    }
