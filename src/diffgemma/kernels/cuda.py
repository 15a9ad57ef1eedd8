"""Fast ops for the CUDA path, each pinned to its `torch_ref` twin by tests/gpu/.

Library first: grouped GEMM (torch grouped_mm), SDPA's flash / memory-efficient kernels. Everything here is
free of host syncs and data-dependent shapes, so a denoise step made of these ops can be captured in a CUDA
graph. The functions also run on CPU (slowly), which is how they are exercised without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch
import torch.nn.functional as F

from diffgemma.kernels.torch_ref import gelu_tanh

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


# -- MoE ---------------------------------------------------------------------------------------------

# The Triton kernels read an expert's weights again for every ~32 of its pairs (block_m * m_slots): right
# for a denoise step (~16 pairs per expert), wrong for a prefill chunk (hundreds), where the grouped GEMMs
# win. bench/moe_kernels.py measures the crossover.
_TRITON_MAX_PAIRS_PER_EXPERT = 32
# Triton kernel modules whose call has failed once (a compile error, say): their torch twins serve from then on.
triton_failed_kernels: set[str] = set()


@functools.cache
def _import_triton_kernels(name: str):
    try:
        return importlib.import_module(f"diffgemma.kernels.{name}")
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken or too old triton: the torch path, loudly
        print(f"diffgemma: triton unusable ({type(e).__name__}: {e}); torch kernels instead", file=sys.stderr)
        return None


def _triton_kernels(name: str):
    """diffgemma.kernels.<name> (a Triton module), or None without a usable triton or after a failed call;
    imported on first use, not at startup."""
    return None if name in triton_failed_kernels else _import_triton_kernels(name)


def triton_failed(name: str, e: Exception) -> None:
    """Record a failed call into kernels.<name>: its torch twin serves from then on, loudly."""
    triton_failed_kernels.add(name)
    msg = str(e).splitlines()[0] if str(e) else ""
    print(f"diffgemma: Triton {name} failed ({type(e).__name__}: {msg}); torch path instead", file=sys.stderr)


def triton_moe_for(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor):
    """kernels.triton_moe when its kernels suit this call (CUDA, 16-bit weights, few pairs per expert and no
    earlier failure), else None."""
    few_pairs = ids.numel() <= _TRITON_MAX_PAIRS_PER_EXPERT * gate_up.shape[0]
    if not (x.is_cuda and few_pairs and gate_up.dtype in (torch.bfloat16, torch.float16)):
        return None
    return _triton_kernels("triton_moe")


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """torch_ref.moe_experts: on CUDA with triton and few pairs per expert (a denoise step's ~16, where the
    grouped GEMMs read the weights at half the memory bandwidth), the two Triton kernels of `triton_moe`;
    otherwise `moe_experts_grouped`. Both round the same way; they differ only in fp32 accumulation order."""
    tm = triton_moe_for(x, ids, gate_up)
    if tm is not None:
        try:
            return tm.moe_experts_triton(x, weights, ids, gate_up, down)
        except Exception as e:  # noqa: BLE001 - any failure: fall back for good, loudly
            triton_failed("triton_moe", e)
    return moe_experts_grouped(x, weights, ids, gate_up, down)


def moe_experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """torch_ref.moe_experts as two grouped GEMMs: sort (row, expert) pairs by expert, gather, gate_up GEMM,
    gelu*up, down GEMM, then a deterministic weighted sum back per row (fp32 accumulation, no atomics)."""
    n, k = ids.shape
    n_exp = gate_up.shape[0]
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    xs = x[perm // k]  # gather: [n*k, H]
    hist_in = sorted_ids.float() if x.device.type != "cuda" else sorted_ids.int()
    counts = torch.histc(hist_in, bins=n_exp, min=0, max=n_exp - 1)  # no host sync (bincount syncs)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    dt = gate_up.dtype
    gu = _grouped_mm(xs.to(dt), gate_up.transpose(1, 2), offs=offs)  # [n*k, 2I]
    inter = gate_up.shape[1] // 2
    act = gelu_tanh(gu[:, :inter]) * gu[:, inter:]
    y = _grouped_mm(act, down.transpose(1, 2), offs=offs)  # [n*k, H]
    unsorted = torch.empty_like(y)
    unsorted[perm] = y
    out = (unsorted.view(n, k, -1).float() * weights.reshape(n, k, 1).float()).sum(1)
    return out.to(x.dtype)


# -- attention ---------------------------------------------------------------------------------------


def attention_nomask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention (the denoise phase), scale 1. q [1, H, T, d], k/v [1, Hkv, S, d].

    GQA is folded into the query length ([1, Hkv, g*T, d]) so that each KV head is read once and no mask is
    needed. d <= 256 (sliding layers) runs SDPA's flash kernel. d = 512 (full layers) has no flash kernel and
    PyTorch's memory-efficient one ran at ~90 TFLOP/s on an H200 (3 ms per layer at 32k); there the scores are
    materialized instead: two cuBLAS GEMMs at several hundred TFLOP/s around an fp32 softmax. The scores come
    out of the GEMM in fp32 (bf16 products, fp32 accumulation, as in the fused kernels) and P is rounded to the
    value dtype before P @ V, as flash kernels do. Memory: Hkv * g*T * S * 6 bytes (3 GiB at 128k)."""
    _, h, t, d = q.shape
    hkv = k.shape[1]
    qf = q.reshape(1, hkv, (h // hkv) * t, d)
    if d > 256 and q.is_cuda:
        scores = torch.bmm(qf[0], k[0].transpose(1, 2), out_dtype=torch.float32)  # [Hkv, g*T, S]
        return torch.bmm(softmax_to(scores, v.dtype), v[0]).reshape(1, h, t, d)
    out = F.scaled_dot_product_attention(qf, k, v, scale=1.0)
    return out.reshape(1, h, t, d)


def softmax_to(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores fp32, dim=-1) rounded to dtype: one Triton pass (kernels/triton_softmax.py) on CUDA where
    triton works, else torch."""
    tk = _triton_kernels("triton_softmax") if scores.is_cuda else None
    if tk is not None:
        try:
            return tk.softmax_rows(scores, dtype)
        except Exception as e:  # noqa: BLE001 - any failure: torch from then on, loudly
            triton_failed("triton_softmax", e)
    return torch.softmax(scores, dim=-1).to(dtype)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def window_blocks(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, groups: int
) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """`attention_window`'s query blocks for a chunk at q_pos [T] over keys at k_pos (the past, then the
    chunk, sorted): (s, e, lo, hi, mask) per block of `window` queries s:e, which sees keys lo:hi (at most
    2*window - 1); mask [groups * (e - s), hi - lo] is the causal window, repeated for the `groups` query heads
    that share a KV head. It depends on positions only, so a chunk builds it once for all its sliding layers
    (per layer, its four elementwise kernels a block were ~400 launches in a 4,096-token chunk)."""
    t = q_pos.shape[0]
    past = k_pos.shape[0] - t
    blocks = []
    for s in range(0, t, window):
        e = min(t, s + window)
        lo, hi = max(0, past + s - window + 1), past + e
        qp, kp = q_pos[s:e], k_pos[lo:hi]
        mask = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
        blocks.append((s, e, lo, hi, mask.repeat(groups, 1)))
    return blocks


def attention_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[tuple[int, int, int, int, torch.Tensor]]
) -> torch.Tensor:
    """Causal sliding-window attention for a prefill chunk (query i sees keys with q - window < pos <= q),
    scale 1. q [1, H, T, d]; k/v [1, Hkv, P + T, d], the past then the chunk; `blocks` from `window_blocks`.

    Each block of queries attends only to the key span it can see, so the masked work is O(T * window), not
    O(T * S). GQA is folded into the query rows ([1, Hkv, g * n, d]) so the KV heads are not expanded."""
    _, h, _, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    for s, e, lo, hi, mask in blocks:
        n = e - s
        qf = q[:, :, s:e].reshape(1, hkv, (h // hkv) * n, d)
        o = F.scaled_dot_product_attention(qf, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=1.0)
        out[:, :, s:e] = o.view(1, h, n, d)
    return out


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
    q: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Full-layer prefill chunk: every query sees all past keys (no mask) and its chunk causally.

    d = 512 on CUDA in 16 bits (the real full layers): `attention_causal_scores`. Otherwise two mask-free
    kernels merged by their log-sum-exps: the past part with GQA folded into the query length, the chunk
    part causal with its (small) K/V expanded to the query heads."""
    _, h, t, d = q.shape
    if d > 256 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return attention_causal_scores(q, past_k, past_v, k, v)
    ch, lse_c = _sdpa_lse(q, _expand_kv(k, h), _expand_kv(v, h), True)
    if past_k.shape[2] == 0:
        return ch
    hkv = past_k.shape[1]
    qf = q.reshape(1, hkv, (h // hkv) * t, d)
    pa, lse_p = _sdpa_lse(qf, past_k, past_v, False)
    pa, lse_p = pa.reshape(1, h, t, d), lse_p.reshape(1, h, t)
    w = torch.sigmoid(lse_p - lse_c)[..., None]  # share of the past in the merged softmax
    return (pa.float() * w + ch.float() * (1 - w)).to(q.dtype)


# The fp32 scores of one query block of `attention_causal_scores` stay under this (S can be 128k keys).
SCORE_BYTES = 2 << 30
# Blocks also skip the chunk's masked upper triangle: a 4096 chunk in blocks of 1024 computes 5/8 of its own
# scores, with GEMMs still g * 1024 = 8192 rows tall.
MAX_QUERY_BLOCK = 1024


def _scores_fp32(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, M, d] @ k [B, N, d]^T in fp32: 16-bit products with fp32 accumulation on CUDA (no rounded
    scores in between), an fp32 GEMM elsewhere."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(q.float(), k.float().transpose(1, 2))


def attention_causal_scores(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int | None = None,
) -> torch.Tensor:
    """attention_causal_past with the scores materialized, as attention_nomask does for d = 512 (where the
    memory-efficient SDPA kernel took 2.8 ms per call on an H200 for a 4k chunk): per block of queries, an fp32
    score GEMM over the past and the chunk's keys up to the block's end, -inf above the diagonal, a softmax
    to the value dtype, a P @ V GEMM. GQA is folded into the rows ([Hkv, g*block]), so each KV head is read
    once per block. q [1, H, T, d], past_k/v [1, Hkv, P, d], k/v [1, Hkv, T, d]; scale 1.

    `block` (queries per block) defaults to MAX_QUERY_BLOCK, or fewer to keep a block's scores under
    SCORE_BYTES."""
    _, h, t, d = q.shape
    hkv, p = k.shape[1], past_k.shape[2]
    g = h // hkv
    keys = torch.cat([past_k, k], dim=2)[0]  # [Hkv, P+T, d]
    vals = torch.cat([past_v, v], dim=2)[0]
    if block is None:
        fit = SCORE_BYTES // (4 * h * (p + t))
        block = min(t, MAX_QUERY_BLOCK, max(64, fit // 64 * 64))
    q4 = q.reshape(hkv, g, t, d)
    out = torch.empty(hkv, g, t, d, device=q.device, dtype=v.dtype)
    for s in range(0, t, block):
        e = min(t, s + block)
        n = e - s
        scores = _scores_fp32(q4[:, :, s:e].reshape(hkv, g * n, d), keys[:, : p + e])  # [Hkv, g*n, P+e]
        # keys past the block's start are the chunk's own: query s+i sees chunk key s+j only for j <= i
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        scores.view(hkv, g, n, p + e)[..., p + s :].masked_fill_(above, float("-inf"))
        probs = softmax_to(scores, v.dtype)
        out[:, :, s:e] = torch.bmm(probs, vals[:, : p + e]).view(hkv, g, n, d)
    return out.view(1, h, t, d)


# -- CUDA graph for the denoise step -------------------------------------------------------------------


class GraphStep:
    """One captured denoise forward for a fixed (cache, cache length, canvas length, SC mode).

    Inputs are copied into static buffers; the output is the graph's static logits (callers clone)."""

    def __init__(self, fn, canvas: torch.Tensor, sc: torch.Tensor | None, pool):
        self.canvas = canvas.clone()
        self.sc = None if sc is None else sc.clone()
        self.fn = fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside capture: cuBLAS handles, SDPA workspaces
            fn(self.canvas, self.sc)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(self.canvas, self.sc)

    def __call__(self, canvas: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
        self.canvas.copy_(canvas, non_blocking=True)
        if self.sc is not None:
            self.sc.copy_(sc, non_blocking=True)
        self.graph.replay()
        return self.out
