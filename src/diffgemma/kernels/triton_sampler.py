"""The sampler's row pass (`engine.sampler.row_stats`) in Triton: per canvas row of logits, the tempered softmax,
its entropy, argmax and top probability.

The torch ops make ~10 passes over the [C, V] fp32 logits (divide, log_softmax, exp, the entropy's product and
sum, max), 1 GB a denoise step at C = 256 and V = 262,144. Here each row is cut into CHUNKS chunks, a program
each, in two kernels that each read the chunk once. Pass 1 keeps per lane a running max m, the rescaled sum s of
exp(z - m) and t of exp(z - m) * (z - m), and the first index of the lane's largest z; lanes are merged into the
chunk's (m, s, t, column). Pass 2's programs merge their row's chunks in chunk order (all alike: deterministic).
With S and T the row's sums at its max M, log p = (z - M) - log S (log_softmax's order of operations), the
entropy is log S - T / S. Pass 2 writes p = exp((z - M) - log S) in fp32 and/or the next step's SC input
(sparse: p where z - M >= the floor, i.e. p >= p_max * e^floor, else 0: the sampler's SC rule in log space, so a
column within rounding of the floor can fall on the other side than in the torch ops), and the top probability
is the largest p. The SC input may be
stored in the model's dtype, into a denoise graph's own input: the graph reads it as a bf16 GEMM operand
anyway, and an fp32 buffer doubled this store and took a cast in the graph (docs/performance.md, "Sampler row
pass").
Rounded to nearest here; the compiled bf16 variant's p differs from the fp32 variant's by fp32 ulps in places,
so 7 of the 67M elements of a real-shape step came one bf16 ulp from torch's cast of the fp32 store.

z = logits * (1 / temp) with the reciprocal rounded to fp32 first: what torch computes for `logits / temp` on
CUDA with a Python float divisor, so z matches it bit for bit and so does the argmax.

With `softcap` the rows are the LM head's output before the final softcap (a denoise graph's bf16 buffer), and
the kernel applies it as it loads them, as `torch_ref.softcap` runs on CUDA (fp32, x * (1 / cap) with the
reciprocal rounded first, tanh, times cap): no separate pass writing the softcapped fp32 logits (67M elements
at the real shape: 134 MB read, 268 MB written) and half the bytes for this kernel's two reads.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from diffgemma.kernels.dispatch import INTERPRET

# Programs a row and columns a program: 32 chunks of 512 columns beat one program a row by a third on the H200's
# [256, 262,144] bf16 rows; the tanh's instructions, not the bytes, bound it (docs/performance.md, "Sampler row pass").
CHUNKS = 32
BLOCK = 512
NUM_WARPS = 4


# Triton 3.6's interpreter has no libdevice (its functions return None): there tanh comes from exp, within fp32
# ulps of it, which the interpreter tests allow for.
_INTERPRET = INTERPRET


@triton.jit
def _load_z(ptr, ok, inv_temp, cap, inv_cap, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    """The tempered logits of one block of a row (masked columns -inf), softcapped first with SOFTCAP."""
    x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        y = x * inv_cap
        if INTERPRET:  # noqa: SIM108 - libdevice only where compiled: one branch traced
            x = (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * cap
        else:
            x = libdevice.tanh(y) * cap
    return tl.where(ok, x * inv_temp, -float("inf"))


@triton.jit
def _merge(m, s, t):
    """Partial (max m, sum s of exp(z - m), sum t of exp(z - m) * (z - m)) merged at their common max:
    (M, S, T)."""
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - m_all)
    return m_all, tl.sum(s * w, axis=0), tl.sum(w * (t + (m - m_all) * s), axis=0)


@triton.jit
def _chunk_stats_kernel(
    x_ptr,
    part_ptr,
    col_ptr,
    n_cols,
    chunk_cols,
    stride_x,
    inv_temp,
    cap,
    inv_cap,
    BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Pass 1 over one chunk of a row: its max m, the sums s of exp(z - m) and t of exp(z - m) * (z - m), and
    the first column of its max, into part [C, chunks, 3] and col [C, chunks]."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK)
    # A finite floor for m: a lane that has seen only masked columns rescales by exp(0) * 0, never inf - inf.
    m = tl.full((BLOCK,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)
    best_col = tl.zeros((BLOCK,), tl.int32)
    start = chunk * chunk_cols
    end = tl.minimum(start + chunk_cols, n_cols)
    # while, not range(start, end, BLOCK): Triton 3.6's interpreter cannot bound a range by a runtime argument.
    while start < end:
        ok = start + cols < end
        z = _load_z(x_row + start + cols, ok, inv_temp, cap, inv_cap, SOFTCAP, INTERPRET)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        d = tl.where(ok, z - m_new, 0.0)  # masked columns: e = 0, and 0 * -inf would be NaN
        e = tl.exp(z - m_new)
        t = scale * (t + (m - m_new) * s) + e * d
        s = s * scale + e
        m = m_new
        first = z > best  # strict: a lane keeps its earliest column among equal values
        best = tl.where(first, z, best)
        best_col = tl.where(first, start + cols, best_col)
        start += BLOCK
    m_c, s_c, t_c = _merge(m, s, t)  # the lanes
    part = part_ptr + (row * tl.num_programs(1) + chunk) * 3
    tl.store(part, m_c)
    tl.store(part + 1, s_c)
    tl.store(part + 2, t_c)
    # an empty chunk (m_c the floor, best -inf) gives n_cols, which the merge never picks
    tl.store(
        col_ptr + row * tl.num_programs(1) + chunk, tl.min(tl.where(best == m_c, best_col, n_cols), axis=0)
    )


@triton.jit
def _chunk_probs_kernel(
    x_ptr,
    part_ptr,
    col_ptr,
    probs_ptr,
    sc_ptr,
    entropy_ptr,
    argmax_ptr,
    p_max_ptr,
    n_cols,
    chunk_cols,
    stride_x,
    stride_p,
    stride_sc,
    inv_temp,
    sc_log_floor,
    cap,
    inv_cap,
    BLOCK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    WRITE_PROBS: tl.constexpr,
    WRITE_SC: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The row's chunks merged (every program of the row alike, in chunk order), then pass 2 over this chunk;
    the first chunk's program stores the row's entropy and argmax, every program its largest p into p_max
    [C, chunks]."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    ks = tl.arange(0, CHUNKS_P2)
    k_ok = ks < n_chunks
    part = part_ptr + (row * n_chunks + ks) * 3
    m_c = tl.load(part, mask=k_ok, other=-1.0e30)
    s_c = tl.load(part + 1, mask=k_ok, other=0.0)
    t_c = tl.load(part + 2, mask=k_ok, other=0.0)
    col_c = tl.load(col_ptr + row * n_chunks + ks, mask=k_ok, other=n_cols)
    m_row, s_row, t_row = _merge(m_c, s_c, t_c)  # the chunks
    log_s = tl.log(s_row)
    first = chunk == 0
    tl.store(entropy_ptr + row, log_s - t_row / s_row, mask=first)
    tl.store(argmax_ptr + row, tl.min(tl.where(m_c == m_row, col_c, n_cols), axis=0).to(tl.int64), mask=first)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    p_row = probs_ptr + row.to(tl.int64) * stride_p
    sc_row = sc_ptr + row.to(tl.int64) * stride_sc
    cols = tl.arange(0, BLOCK)
    # p_max as the max of the stored p, not exp(-log S): on the H200 the two differed by an ulp in some rows.
    p_max = tl.zeros((BLOCK,), tl.float32)
    start = chunk * chunk_cols
    end = tl.minimum(start + chunk_cols, n_cols)
    while start < end:
        ok = start + cols < end
        z = _load_z(x_row + start + cols, ok, inv_temp, cap, inv_cap, SOFTCAP, INTERPRET)
        p = tl.exp((z - m_row) - log_s)
        if WRITE_PROBS:
            tl.store(p_row + start + cols, p, mask=ok)
        if WRITE_SC:  # the SC input, in its buffer's dtype; sparse: log p - log p_max = z - M >= the floor
            sc = tl.where(z - m_row >= sc_log_floor, p, 0.0)
            # a downcast rounds to nearest even on the GPU, as torch's cast (Triton 3.6's interpreter truncates)
            tl.store(sc_row + start + cols, sc.to(sc_ptr.dtype.element_ty), mask=ok)
        p_max = tl.maximum(p_max, p)
        start += BLOCK
    tl.store(p_max_ptr + row * n_chunks + chunk, tl.max(p_max, axis=0))


def row_stats(
    logits: torch.Tensor,
    temp: float,
    sc_log_floor: float | None = None,
    need_probs: bool = True,
    sc_out: torch.Tensor | None = None,
    softcap: float | None = None,
    chunks: int = CHUNKS,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [C, V] fp32, sc [C, V], entropy [C], argmax [C] int64, p_max [C]) of softmax(logits / temp); logits
    [C, V] fp32 with unit column stride, or with `softcap` logits before the final softcap (any float dtype),
    softcapped as they are read.

    sc: the next step's SC probabilities: with `sc_log_floor`, p where log p >= log p_max + sc_log_floor and 0
    elsewhere, else the probs themselves; written to `sc_out` when given, fp32 or the model's dtype (a denoise
    graph's input, rounded here). Without `need_probs` the dense probs are not written when sc is sparse or in
    another dtype (probs is None)."""
    if (logits.dtype != torch.float32 and softcap is None) or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"row_stats wants [C, V] rows with unit stride, fp32 unless softcapped here, got {logits.dtype} "
            f"{logits.stride()}"
        )
    c, v = logits.shape
    dev = logits.device
    if sc_out is not None and (
        sc_out.shape != (c, v) or not sc_out.dtype.is_floating_point or sc_out.stride(1) != 1
    ):
        raise ValueError(
            f"row_stats: sc_out must be [{c}, {v}] float rows, got {sc_out.dtype} {tuple(sc_out.shape)}"
        )
    # sc apart from the probs: sparse, or in another dtype than theirs
    apart = sc_log_floor is not None or (sc_out is not None and sc_out.dtype != torch.float32)
    if apart:
        probs = torch.empty(c, v, device=dev, dtype=torch.float32) if need_probs else None
        sc = torch.empty(c, v, device=dev, dtype=torch.float32) if sc_out is None else sc_out
    else:  # sc is the probs
        probs = sc = torch.empty(c, v, device=dev, dtype=torch.float32) if sc_out is None else sc_out
    entropy = torch.empty(c, device=dev, dtype=torch.float32)
    argmax = torch.empty(c, device=dev, dtype=torch.int64)
    inv_temp = float(np.float32(1.0) / np.float32(temp))
    cap = 1.0 if softcap is None else float(np.float32(softcap))
    inv_cap = float(np.float32(1.0) / np.float32(cap))
    chunks = min(chunks, triton.cdiv(v, block))
    chunk_cols = triton.cdiv(triton.cdiv(v, chunks), 16) * 16  # 16-aligned chunk starts: vector loads
    part = torch.empty(c, chunks, 3, device=dev, dtype=torch.float32)
    part_col = torch.empty(c, chunks, device=dev, dtype=torch.int32)
    part_p_max = torch.empty(c, chunks, device=dev, dtype=torch.float32)
    common = dict(cap=cap, inv_cap=inv_cap, BLOCK=block, SOFTCAP=softcap is not None, INTERPRET=_INTERPRET)
    _chunk_stats_kernel[(c, chunks)](
        logits,
        part,
        part_col,
        v,
        chunk_cols,
        logits.stride(0),
        inv_temp,
        **common,
        num_warps=num_warps,
    )
    _chunk_probs_kernel[(c, chunks)](
        logits,
        part,
        part_col,
        sc if probs is None else probs,  # an unused pointer when not written
        sc,
        entropy,
        argmax,
        part_p_max,
        v,
        chunk_cols,
        logits.stride(0),
        sc.stride(0) if probs is None else probs.stride(0),
        sc.stride(0),
        inv_temp,
        -float("inf") if sc_log_floor is None else sc_log_floor,
        **common,
        CHUNKS_P2=triton.next_power_of_2(chunks),
        WRITE_PROBS=probs is not None,
        WRITE_SC=apart,
        num_warps=num_warps,
    )
    p_max = part_p_max.amax(1)
    return probs, sc, entropy, argmax, p_max
