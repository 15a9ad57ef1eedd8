"""Fast ops built on torch's library kernels (grouped GEMM, SDPA, cuBLAS GEMMs around one Triton pass), each
pinned to its `torch_ref` twin by tests/gpu/. They take Triton kernels through `dispatch` where those serve (CUDA,
the shapes and dtypes each kernel is built for) and run on any device otherwise, which is how they are exercised
without a GPU. Everything here is free of host syncs and data-dependent shapes, so a denoise step made of these
ops can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffgemma.kernels import dispatch
from diffgemma.kernels.torch_ref import gelu_tanh, keep_top, rows, sum_sorted_pairs, topk_keys
from diffgemma.quant.formats import FP8_MAX
from diffgemma.quant.weight import QuantWeight, dense

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


# -- MoE ---------------------------------------------------------------------------------------------

# Pairs per expert up to which the Triton kernels serve (`triton_moe.config_for` picks their tiles); above,
# the grouped GEMMs (docs/performance.md, "Expert kernels").
TRITON_MAX_PAIRS_PER_EXPERT = 512
# (activations, weights): fp32 on bf16 is a short prompt's prefill (seed rule 7), without an fp32 copy of the
# experts (docs/performance.md, "Expert kernels").
_TRITON_MOE_DTYPES = {
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
}


def triton_moe_for(x: torch.Tensor, n_pairs: int, gate_up: torch.Tensor | QuantWeight, fixed: bool = False):
    """kernels.triton_moe when its kernels suit this call (CUDA, 16-bit weights and activations in their dtype,
    or fp32 ones on bf16 on the denoise tiles; int4 or fp8 experts under bf16, fp16 or fp32 activations; not more
    pairs an expert than their limit), else None. `fixed` (the batch-invariant mode, which pins one tile set):
    any pair count, so that no batch size sends the pairs to the grouped GEMMs."""
    n_exp = gate_up.shape[0]
    if fixed:
        n_pairs = 0
    if n_pairs > TRITON_MAX_PAIRS_PER_EXPERT * n_exp:
        return None
    if isinstance(gate_up, QuantWeight):  # dequantized in the kernels to x's dtype (bf16 under fp32)
        ok = gate_up.fmt in ("int4", "fp8") and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        tm = dispatch.triton("triton_moe", x, fits=ok)
        # fp32 activations (three MMAs a step) on the denoise tiles only, as for bf16 weights
        return None if tm is None or (x.dtype == torch.float32 and not tm.few_pairs(n_pairs, n_exp)) else tm
    if (x.dtype, gate_up.dtype) not in _TRITON_MOE_DTYPES:
        return None
    tm = dispatch.triton("triton_moe", x)
    # fp32 activations (three bf16 MMAs a step) only on the denoise tiles, measured at a short prompt's sizes
    if tm is not None and x.dtype != gate_up.dtype and not tm.few_pairs(n_pairs, n_exp):
        return None
    return tm


def triton_attn_for(q: torch.Tensor):
    """kernels.triton_attn when its kernels suit this call (CUDA, 16-bit, a power-of-two head_dim of at least
    16), else None. Their tiles are sized for 16-bit operands: fp32 ones (a short prompt's prefill) ask for more
    shared memory than an H200 has, and a failure would switch the module off."""
    d = q.shape[-1]
    fits = q.dtype in (torch.bfloat16, torch.float16) and d >= 16 and d & (d - 1) == 0
    return dispatch.triton("triton_attn", q, fits=fits)


def _gluon_for(x: torch.Tensor, n_pairs: int, gate_up, down):
    """kernels.gluon_moe when its kernels serve these experts (int4, bf16 activations, moe_shuffle's 64 x 64 tiles,
    up to gluon_moe.MAX_PAIRS_PER_EXPERT pairs an expert on average), else None."""
    if not (isinstance(gate_up, QuantWeight) and isinstance(down, QuantWeight)):
        return None
    tiles = all(d % 64 == 0 for d in (*gate_up.shape[1:], *down.shape[1:]))
    fits = x.dtype == torch.bfloat16 and gate_up.fmt == down.fmt == "int4" and tiles
    gm = dispatch.triton("gluon_moe", x, fits=fits)
    return None if gm is None or n_pairs > gm.MAX_PAIRS_PER_EXPERT * gate_up.shape[0] else gm


def experts_sorted_gluon(
    x: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor, top_k: int, gate_up, down
) -> torch.Tensor | None:
    """int4 experts at a denoise step on `gluon_moe`'s register-operand kernels and the pre-shuffled copy
    (`moe_shuffle.cached`), on pairs sorted by expert: y [N*k, H] in sorted order, as `triton_moe.down_sorted`.
    0.348 against 0.400 ms a layer (H100) for triton_moe's int4 kernels (docs/performance.md, "Quantized
    weights"). None where they do not serve (`_gluon_for`; then triton_moe); fp8 stays on triton_moe, where the
    two measured alike."""
    if _gluon_for(x, perm.numel(), gate_up, down) is None:
        return None

    def call(m):
        from diffgemma.kernels import moe_shuffle

        sg, sd = moe_shuffle.cached(gate_up), moe_shuffle.cached(down)
        return None if sg is None or sd is None else m.experts_sorted(x, sg, sd, perm, bounds, top_k)

    return dispatch.attempt("gluon_moe", call, x)


def _moe_experts_gluon(x, weights, ids, gate_up: QuantWeight, down: QuantWeight) -> torch.Tensor | None:
    """`experts_sorted_gluon` on unsorted routing, summed back per row; None where it does not serve."""
    gm = _gluon_for(x, ids.numel(), gate_up, down)
    if gm is None:
        return None
    perm, bounds = gm.sort_pairs(ids, gate_up.shape[0])
    y = experts_sorted_gluon(x, perm, bounds, ids.shape[1], gate_up, down)
    return None if y is None else sum_sorted_pairs(y, perm, weights).to(x.dtype)


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """torch_ref.moe_experts: on CUDA with triton, the two Triton kernels of `triton_moe` for a denoise step
    (~16 pairs an expert, where the grouped GEMMs read the weights at half the memory bandwidth) and prefill
    chunks up to TRITON_MAX_PAIRS_PER_EXPERT; otherwise `moe_experts_grouped`. Both round the same way; they
    differ only in fp32 accumulation order. The weights may be narrower than x (bf16 experts, fp32
    activations): the result is computed in x's dtype."""
    if isinstance(gate_up, QuantWeight) and gate_up.fmt == "int4":
        out = _moe_experts_gluon(x, weights, ids, gate_up, down)
        if out is not None:
            return out
    tm = triton_moe_for(x, ids.numel(), gate_up)
    if tm is not None:
        out = dispatch.attempt(
            "triton_moe", lambda m: m.moe_experts_triton(x, weights, ids, gate_up, down), x
        )
        if out is not None:
            return out
    return moe_experts_grouped(x, weights, ids, gate_up.to(x.dtype), down.to(x.dtype))


def moe_experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """torch_ref.moe_experts as two grouped GEMMs: sort (row, expert) pairs by expert, `experts_grouped`, then a
    deterministic weighted sum back per row (fp32 accumulation, no atomics). Computed in the weights' dtype."""
    n_exp = gate_up.shape[0]
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    hist_in = sorted_ids.float() if x.device.type != "cuda" else sorted_ids.int()
    counts = torch.histc(hist_in, bins=n_exp, min=0, max=n_exp - 1)  # no host sync (bincount syncs)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    y = experts_grouped(x.to(gate_up.dtype), perm, offs, ids.shape[1], gate_up, down)
    return sum_sorted_pairs(y, perm, weights).to(x.dtype)


def _gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    inter = gu.shape[-1] // 2
    return gelu_tanh(gu[:, :inter]) * gu[:, inter:]


def experts_grouped(
    x: torch.Tensor,
    perm: torch.Tensor,
    offs: torch.Tensor,
    k: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gelu_mul: Callable[[torch.Tensor], torch.Tensor] = _gelu_mul,
) -> torch.Tensor:
    """Each sorted pair's expert output [N*k, H], unweighted, in x's dtype: the rows x[perm // k] gathered, then the
    gate_up GEMM, `gelu_mul` (gelu(gate) * up; a compiled region where the caller has one) and the down GEMM, each
    grouped by expert (`offs`: each expert's end in the sorted pairs, int32 [E])."""
    dt = x.dtype  # quantized experts (no kernel for this call) are dequantized whole for the grouped GEMMs
    gu = _grouped_mm(x[perm // k], dense(gate_up, dt).transpose(1, 2), offs=offs)  # [N*k, 2I]
    return _grouped_mm(gelu_mul(gu), dense(down, dt).transpose(1, 2), offs=offs)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with one fp32 scale a row (dynamic activation quantization, as vLLM's FP8-dynamic)."""
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def linear_fp8(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x @ w.T for an fp8 weight (one fp32 scale an output channel) as one fp8 GEMM on the tensor cores: x
    quantized per row (`quantize_rows_fp8`), fp32 accumulation, out in x's dtype."""
    lead = x.shape[:-1]
    xq, sx = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(
        xq, w.parts[""].t(), scale_a=sx, scale_b=w.parts["_scale"].reshape(1, -1), out_dtype=x.dtype
    )
    return out.view(*lead, -1)


# -- attention ---------------------------------------------------------------------------------------


def attention_nomask(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: tuple[torch.Tensor, int] | None = None,
    valid: torch.Tensor | None = None,
    topk: bool = False,
) -> torch.Tensor:
    """Unmasked attention (the denoise phase), scale 1. q [1, H, T, d], k/v [1, Hkv, S, d].

    GQA is folded into the query length ([1, Hkv, g*T, d]) so that each KV head is read once and no mask is
    needed. d <= 256 (sliding layers) runs the split-KV Triton kernel (kernels/triton_attn.py: 21 against
    SDPA's 35 us a layer on an H200, whose cuDNN kernel fills only 64 of the 132 SMs) and returns a view of the
    [T, H, d] rows o_proj reads, else SDPA. d = 512 (full layers) has no flash kernel and PyTorch's
    memory-efficient one ran at ~90 TFLOP/s on an H200 (3 ms per layer at 32k); there the scores are
    materialized instead: two cuBLAS GEMMs at several hundred TFLOP/s around one Triton pass over the fp32
    scores. As in flash kernels: the scores in fp32 (bf16 products, fp32 accumulation), P = exp(s - c)
    unnormalized and rounded to the value dtype before P @ V (fp32 out), the division by the row sums after it.
    Memory: Hkv * g*T * S * 6 bytes (3 GiB at 128k).

    Read on the device, so that a CUDA graph serves any cache length: `span` = (int32 [2], n_max), the keys are
    slots span[0] .. span[0] + span[1] of k and v (at most n_max of them); `valid` (int32 [1]): only the first
    valid[0] keys count. `topk` (with `valid`, on CUDA): the seed's top-k sparse attention on the materialized
    scores (`_attend_topk`), k = clamp(valid[0] / 128, 64, 512)."""
    _, h, t, d = q.shape
    hkv = k.shape[1]
    qf = q.reshape(1, hkv, (h // hkv) * t, d)
    # the fast paths write o_proj's input rows [T, H, d] (as [Hkv, g, T, d]): `ref.rows` of the view they return
    # is free
    rows = torch.empty(t, h, d, device=q.device, dtype=q.dtype)
    heads = rows.view(t, hkv, h // hkv, d).permute(1, 2, 0, 3)
    if topk and (valid is None or span is not None or not q.is_cuda):
        raise ValueError("attention_nomask: top-k reads a count of valid keys on a CUDA device (full layers)")
    if (d > 256 or topk) and q.is_cuda and span is None:
        _attend_materialized(qf[0], k[0], v[0], heads, valid=valid, topk=topk)
        return rows.transpose(0, 1)[None]
    if valid is None and triton_attn_for(q) is not None:

        def splitkv(m) -> bool:
            m.attention_splitkv(qf, k, v, out=heads, span=span)
            return True

        if dispatch.attempt("triton_attn", splitkv, q):
            return rows.transpose(0, 1)[None]
    mask = None
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if (span is not None or valid is not None) and not capturing:
        # outside a graph the keys are sliced exactly (a host read): the same sums as without a span
        first, count = span[0].tolist() if span is not None else (0, int(valid))
        k, v = k[:, :, first : first + count], v[:, :, first : first + count]
    elif span is not None:  # in a graph: n_max slots from span[0], the count masked
        (k, v), valid = _span_slots(k, v, span), span[0][1:]
    if valid is not None and capturing:
        mask = torch.zeros(1, k.shape[2], device=q.device, dtype=q.dtype)  # [queries, keys], broadcast
        mask = mask.masked_fill(torch.arange(k.shape[2], device=q.device) >= valid, float("-inf"))
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=1.0)
    return out.reshape(1, h, t, d)


def attention_commit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: tuple[torch.Tensor, int] | None = None,
    valid: torch.Tensor | None = None,
    window: int | None = None,
    topk: bool = False,
) -> torch.Tensor:
    """Causal attention of a block's commit on a denoise step's geometry: the T queries are the last T keys (the
    canvas slots), query i sees the keys up to its own and, with `window`, no more than `window` of them (a
    sliding layer's). q [1, H, T, d], k/v [1, Hkv, S, d], scale 1; `span` or `valid` as for attention_nomask,
    always read on the device, so that a CUDA graph and an eager call run the same kernels. Returns o_proj's
    rows as attention_nomask does. A span (sliding layers) takes SDPA with a mask built on the device; `valid`
    (full layers) the materialized scores, with the causal limits counted back from valid, top-k sparse with
    `topk` as in attention_nomask."""
    if (span is None) == (valid is None):
        raise ValueError(
            "attention_commit takes a span (sliding layers) or a count of valid keys (full layers)"
        )
    if topk and valid is None:
        raise ValueError("attention_commit: top-k reads a count of valid keys (full layers)")
    _, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qf = q.reshape(1, hkv, g * t, d)
    rows = torch.empty(t, h, d, device=q.device, dtype=q.dtype)
    heads = rows.view(t, hkv, g, d).permute(1, 2, 0, 3)
    if valid is not None:
        _attend_materialized(qf[0], k[0], v[0], heads, valid=valid, tail=t, topk=topk)
        return rows.transpose(0, 1)[None]
    n_max = span[1]
    k, v = _span_slots(k, v, span)
    own = span[0][1] - t + torch.arange(g * t, device=q.device) % t  # each query's own key in the span
    cols = torch.arange(n_max, device=q.device)
    keep = cols[None, :] <= own[:, None]
    if window is not None:
        keep &= cols[None, :] > own[:, None] - window
    mask = torch.zeros(g * t, n_max, device=q.device, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=1.0)
    heads.copy_(out[0].view(hkv, g, t, d))
    return rows.transpose(0, 1)[None]


def _span_slots(
    k: torch.Tensor, v: torch.Tensor, span: tuple[torch.Tensor, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [1, Hkv, n_max, d] of the slots span[0][0] .. + n_max (clamped to the buffer), gathered on the
    device: the same shapes whatever the span, as a CUDA graph needs."""
    idx = (span[0][0].long() + torch.arange(span[1], device=k.device)).clamp(max=k.shape[2] - 1)
    return k.index_select(2, idx), v.index_select(2, idx)


def exp_to(
    scores: torch.Tensor,
    dtype: torch.dtype,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, sums): p = exp(scores - c) in dtype, c near each row's max, and sums its fp32 row sums before
    rounding: softmax(scores) = p / sums (flash kernels' P, the division after P @ V). One Triton pass
    (kernels/triton_softmax.py `exp_rows`) on CUDA where triton works, else torch. `causal` = (base, period): row
    r keeps only its first base + r % period columns (the causal mask of a block of queries); `valid` (int32
    [1], on the device): no row keeps more than its first valid[0] columns; `tail` (with valid): row r keeps its
    first valid[0] - tail + 1 + r % tail (queries that are the last `tail` keys). p is 0 past what a row keeps."""
    out = dispatch.attempt("triton_softmax", lambda m: m.exp_rows(scores, dtype, causal, valid, tail), scores)
    if out is not None:
        return out
    scores = _mask_rows(scores, causal, valid, tail)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return p.to(dtype), p.sum(-1)


def _mask_rows(
    scores: torch.Tensor,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
) -> torch.Tensor:
    """scores with -inf past what each row keeps (`exp_to`'s limits), in torch ops."""
    cols = torch.arange(scores.shape[-1], device=scores.device)
    if tail is not None:
        causal = (valid + 1 - tail, tail)  # a base on the device: torch's ops take it as it is
    if causal is not None:
        base, period = causal
        r = torch.arange(scores.shape[-2], device=scores.device)[:, None] % period
        scores = scores.masked_fill(cols >= base + r, float("-inf"))
    if valid is not None:
        scores = scores.masked_fill(cols >= valid, float("-inf"))
    return scores


def _attend_materialized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
    topk: bool = False,
    keep: int | None = None,
) -> None:
    """out [Hkv, g, T, d] = softmax(q @ k.T) @ v for q [Hkv, g*T, d] and k, v [Hkv, S, d], scale 1, with the fp32
    scores materialized: two GEMMs around `exp_to` (`causal`, `valid`, `tail` as there), the division last; with
    `topk`, the seed's top-k sparse attention on those scores (`_attend_topk`, `keep` keys a row, None: from
    valid)."""
    scores = _bmm_fp32(q, k.transpose(1, 2))
    if topk:
        _attend_topk(scores, v, out, keep, causal, valid, tail)
        return
    p, sums = exp_to(scores, v.dtype, causal, valid, tail)
    divide_rows(_bmm_fp32(p, v), sums, out)


def _attend_topk(
    scores: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    keep: int | None,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
) -> None:
    """out [Hkv, g, T, d] = softmax over each row's `keep` best fp32 scores [Hkv, g*T, S] (None: clamp(valid[0] /
    128, 64, 512)), ties to the lower key, times v [Hkv, S, d] in fp32: `torch_ref.attention_topk` on
    materialized scores, with `exp_to`'s row limits. The Triton selection and gathered P.V
    (kernels/triton_topk.py), else torch (a sort of every row and a host read of valid)."""

    def kernels(m) -> torch.Tensor:
        return m.gather_pv(*m.select_rows(scores, keep, causal, valid, tail), v, out)

    if dispatch.attempt("triton_topk", kernels, scores) is not None:
        return
    if keep is None:
        keep = topk_keys(int(valid))
    p = torch.softmax(keep_top(_mask_rows(scores, causal, valid, tail), keep), dim=-1)
    out.copy_((p @ v.float()).view(out.shape))


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] in fp32: 16-bit products with fp32 accumulation on CUDA (no rounded
    output), an fp32 GEMM elsewhere."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def divide_rows(x: torch.Tensor, sums: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [H, G, T, n] = x [H, G*T, n] fp32 / sums[..., None], rounded once to out's dtype."""
    done = dispatch.attempt("triton_softmax", lambda m: m.divide_rows(x, sums, out), x)
    if done is not None:
        return done
    return out.copy_((x / sums[..., None]).view(out.shape))


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


# Queries per block of the sliding-window prefill. A block of b queries reads the b + window keys its queries may
# see, of which each sees window: blocks of `window` (1024) computed twice the scores they kept. On an H200, one
# real-shape layer over a 4096-token chunk: blocks of 1024 1.23 ms, of 512 0.58, of 256 0.53, of 128 0.49.
WINDOW_QUERY_BLOCK = 128


def window_bias(
    past: int,
    t: int,
    window: int,
    groups: int,
    dtype: torch.dtype,
    device: torch.device | str,
    block: int = WINDOW_QUERY_BLOCK,
) -> torch.Tensor:
    """`attention_window`'s additive mask for a chunk of t queries after `past` cached positions that the window
    still sees (at most window - 1): [blocks, 1, groups * block, block + window], 0 where a query may see a key
    and -inf elsewhere, the rows repeated for the `groups` query heads of a KV head.

    Block n's keys are slots n*block .. n*block + block + window - 1 of a buffer that holds the `window` positions
    before the chunk, then the chunk: its query r (chunk query n*block + r, buffer slot window + n*block + r)
    sees slots r+1 .. r+window of that span, if they hold a position (slot >= window - past). Once past >=
    window - 1 every block's mask is the same, and one block's is returned (SDPA broadcasts it). It depends on
    lengths only, so a chunk builds it once for all its sliding layers."""
    nb = 1 if past >= window - 1 else -(-t // block)
    r = torch.arange(block, device=device)[:, None]
    j = torch.arange(block + window, device=device)[None, :]
    n = torch.arange(nb, device=device)[:, None, None]
    seen = (j > r) & (j <= r + window) & (n * block + j >= window - past)
    bias = torch.zeros(nb, block, block + window, device=device, dtype=dtype).masked_fill_(
        ~seen, float("-inf")
    )
    return bias.repeat(1, groups, 1)[:, None]


def attention_window(
    q: torch.Tensor, past: torch.Tensor, chunk: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Causal sliding-window attention of a prefill chunk (query i sees keys with i - window < pos <= i), scale
    1, as rows [T, H * d] (o_proj's input). q [1, H, T, d]; past [2, Hkv, n, d]: K and V of the n <= window - 1
    positions before the chunk; chunk [2, Hkv, T, d]: the chunk's own; bias: `window_bias` (its shape gives the
    block and the window).

    On CUDA with d a power of two <= 256: the Triton kernel `triton_attn.attention_window_rows`, which reads
    past and chunk in place, walks only each query block's window and writes the rows.

    Else (and after a Triton failure) one SDPA call for all blocks of queries: the past and the chunk are copied
    into one buffer, and block n's keys are a strided view of it (no copy per block). GQA is folded into the
    query rows, so the KV heads are not expanded. Slots that hold no position are zeros (masked, but a NaN there
    would still poison P @ V)."""
    _, h, t, d = q.shape
    hkv, n = chunk.shape[1], past.shape[2]
    g = h // hkv
    b = bias.shape[2] // g
    w = bias.shape[3] - b
    if d <= 256 and triton_attn_for(q) is not None:  # a failure switches the module off: the denoise's too
        out = dispatch.attempt("triton_attn", lambda m: m.attention_window_rows(q, past, chunk, w), q)
        if out is not None:
            return out
    nb = -(-t // b)
    tp = nb * b
    buf = torch.empty(2, hkv, w + tp, d, device=q.device, dtype=q.dtype)
    buf[:, :, : w - n].zero_()
    buf[:, :, w - n : w].copy_(past)
    buf[:, :, w : w + t].copy_(chunk)
    buf[:, :, w + t :].zero_()
    qp = q if tp == t else F.pad(q, (0, 0, 0, tp - t))
    qf = qp[0].view(hkv, g, nb, b, d).permute(2, 0, 1, 3, 4).reshape(nb, hkv, g * b, d)
    stride = (b * d, (w + tp) * d, d, 1)
    k = buf[0].as_strided((nb, hkv, b + w, d), stride)
    v = buf[1].as_strided((nb, hkv, b + w, d), stride)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=1.0)
    return o.view(nb, hkv, g, b, d).permute(0, 3, 1, 2, 4).reshape(tp, h * d)[:t]


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Attention output and its log-sum-exp [B, H, T] (fp32), scale 1; heads already matched."""
    t = q.shape[2]
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=1.0
        )[:2]
        return out, lse[..., :t].float()
    s = q.float() @ k.float().transpose(-1, -2)
    if causal:
        s = s.masked_fill(~torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), lse


def attention_causal_past(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, topk: bool = False
) -> torch.Tensor:
    """Full-layer prefill chunk, as rows [T, H * d]: every query sees all past keys and its chunk causally.
    q [1, H, T, d]; keys/vals [1, Hkv, P + T, d], the past then the chunk's own (the cache's view after the
    chunk's write: no concatenation).

    d = 512 on CUDA in 16 bits (the real full layers), and top-k on CUDA: `attention_causal_scores`. Otherwise
    two mask-free kernels merged by their log-sum-exps: the past part with GQA folded into the query length, the
    chunk part causal with its (small) K/V expanded to the query heads."""
    _, h, t, d = q.shape
    if topk and not q.is_cuda:
        raise ValueError(
            "attention_causal_past: top-k runs on a CUDA device (the reference kernels' elsewhere)"
        )
    if topk or (d > 256 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return attention_causal_scores(q, keys, vals, topk=topk)
    p = keys.shape[2] - t
    k, v = keys[:, :, p:], vals[:, :, p:]
    ch, lse_c = _sdpa_lse(q, _expand_kv(k, h), _expand_kv(v, h), True)
    if p == 0:
        return rows(ch)
    hkv = keys.shape[1]
    qf = q.reshape(1, hkv, (h // hkv) * t, d)
    pa, lse_p = _sdpa_lse(qf, keys[:, :, :p], vals[:, :, :p], False)
    pa, lse_p = pa.reshape(1, h, t, d), lse_p.reshape(1, h, t)
    w = torch.sigmoid(lse_p - lse_c)[..., None]  # share of the past in the merged softmax
    return rows((pa.float() * w + ch.float() * (1 - w)).to(q.dtype))


# The fp32 scores of one query block of `attention_causal_scores` stay under this (S can be 128k keys).
SCORE_BYTES = 2 << 30
# Blocks also skip the chunk's masked upper triangle: a 4096 chunk in blocks of 1024 computes 5/8 of its own
# scores, with GEMMs still g * 1024 = 8192 rows tall.
MAX_QUERY_BLOCK = 1024


def attention_causal_scores(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, block: int | None = None, topk: bool = False
) -> torch.Tensor:
    """attention_causal_past with the scores materialized, as attention_nomask does for d = 512 (where the
    memory-efficient SDPA kernel took 2.8 ms per call on an H200 for a 4k chunk): per block of queries,
    `_attend_materialized` over the past and the chunk's keys up to the block's end, with the causal limit in
    `exp_to`. GQA is folded into the rows ([Hkv, g*block]), so each KV head is read once per block. q [1, H, T,
    d], keys/vals [1, Hkv, P + T, d] (the chunk's last); scale 1. Returns rows [T, H * d].

    `block` (queries per block) defaults to MAX_QUERY_BLOCK, or fewer to keep a block's scores under
    SCORE_BYTES. `topk`: the seed's top-k sparse attention, k = clamp((P + T) / 128, 64, 512) of the chunk's keys
    in all, as the reference counts them (`torch_ref.attention_topk`)."""
    _, h, t, d = q.shape
    hkv, p = keys.shape[1], keys.shape[2] - t
    g = h // hkv
    if block is None:
        fit = SCORE_BYTES // (4 * h * (p + t))
        block = min(t, MAX_QUERY_BLOCK, max(64, fit // 64 * 64))
    q4 = q.reshape(hkv, g, t, d)
    out = torch.empty(t, hkv, g, d, device=q.device, dtype=vals.dtype)
    for s in range(0, t, block):
        e = min(t, s + block)
        n = e - s
        # row i of each n (query s+i) sees the past and chunk keys up to its own: the first p + s + i + 1
        qb = q4[:, :, s:e].reshape(hkv, g * n, d)
        kb, vb = keys[0, :, : p + e], vals[0, :, : p + e]
        _attend_materialized(
            qb, kb, vb, out[s:e].permute(1, 2, 0, 3), causal=(p + s + 1, n), topk=topk, keep=topk_keys(p + t)
        )
    return out.view(t, h * d)


# -- self-conditioning -------------------------------------------------------------------------------


def soft_embedding(probs: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """probs [N, V] @ embed [V, H] in embed's dtype, probs cast to it first. On CUDA for 16-bit embeddings the
    survivor gather (kernels/triton_sc_embed.py: a row's nonzero probabilities only, the dense GEMM for rows
    with more than its cap), equal to the GEMM up to summation order; else (and while embed takes gradients)
    the GEMM."""
    fits = (
        probs.dim() == 2
        and embed.dtype in (torch.bfloat16, torch.float16)
        and embed.stride(-1) == 1
        and not (torch.is_grad_enabled() and (embed.requires_grad or probs.requires_grad))
    )
    out = dispatch.attempt("triton_sc_embed", lambda m: m.soft_embedding(probs, embed), probs, fits)
    return out if out is not None else probs.to(embed.dtype) @ embed
