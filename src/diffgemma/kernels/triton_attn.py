"""Split-KV attention (flash-decoding style) for a denoise step's sliding layers: q [1, Hkv, M, d] with GQA
folded into the rows (M = g * 256 canvas queries), k/v [1, Hkv, S, d] views of the KV cache (S = 1,023
window keys + 256 canvas keys), d = 256, scale 1, no mask.

`F.scaled_dot_product_attention` (cuDNN, 64 x 128 tiles) runs this as 64 programs on the H200's 132 SMs,
35 us a layer where the two GEMMs' 5.4 GFLOP take ~7 us at the dense-GEMM rate. Here the keys are split
too: kernel 1, grid (cdiv(M, BLOCK_M), Hkv, splits), gives each program one Q tile and one contiguous range
of key blocks, runs an online softmax over it and writes its unnormalized fp32 output with the range's row
max and sum; kernel 2 merges the splits per row in a fixed order (deterministic, no atomics) and writes q's
dtype. 21 us a layer on the H200 (bench/attention_denoise.py).

The math is a flash kernel's: scores are dots of the input dtype accumulated in fp32, the softmax is fp32,
P is rounded to v's dtype before P @ V, the output accumulates in fp32. The number of key blocks a split
walks is a compile-time constant (see the loop): one compile per value, at most 10 for a sliding layer
(S <= 1,279 in 2 splits of 64-key blocks), and none once the window is full.

`attention_window_rows` is a prefill chunk's sliding-window attention (T queries after n <= window - 1 cached
positions, each seeing the window keys up to itself) in the same flash math, one program per block of
queries of one head, writing o_proj's rows [T, H * d]. It reads the cached past and the chunk's own K/V where
they lie and walks only the window of each query block, where `cuda.attention_window`'s SDPA call copies both
into one buffer and computes 128 + window keys per block of 128 queries, half of them masked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from diffgemma.kernels import pdl

# Chosen on the H200 at the sliding shape (bench/attention_denoise.py --splitkv-sweep): 21 us. These tiles
# take 164-224 KB of shared memory (2-3 stages), one program an SM, and one wave of programs (2 splits of
# 8 x 8 row blocks and heads: 128) beat two (4 splits of the same tiles: 27-29 us); block_m 128 with 8 warps
# in 4 splits came next (23 us).
SPLITS: int | None = None  # None: `_auto_splits`
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MIN_SPLIT_BLOCKS = 4  # splits=None splits no range below this many key blocks
COMBINE_ROWS = 16


@triton.jit
def _splitkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    span_ptr,
    M,
    S,
    stride_qh,
    stride_qm,
    stride_kh,
    stride_kn,
    stride_vh,
    stride_vn,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    HAS_SPAN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ds = tl.arange(0, D)
    q = tl.load(
        q_ptr + head * stride_qh + rows[:, None] * stride_qm + ds[None, :], mask=row_ok[:, None], other=0.0
    )
    k_rows = k_ptr + head * stride_kh + ds[None, :]
    v_rows = v_ptr + head * stride_vh + ds[None, :]
    if HAS_SPAN:  # the keys are slots span[0] .. span[0] + span[1] of k and v, read on the device
        first = tl.load(span_ptr).to(tl.int64)
        S = tl.load(span_ptr + 1)
        k_rows += first * stride_kn
        v_rows += first * stride_vn
    # Base-2 softmax: scores times log2(e), then exp2 (tl.exp lowers to a multiply and ex2.approx anyway; here
    # the multiply folds into the max subtraction). The row max is in log2 units; the combine uses exp2 too.
    # A finite floor for the max: a split with no keys writes max -1e30, sum 0, acc 0, which the combine weighs
    # by exp2(-1e30 - m*) = 0, never inf - inf.
    row_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    start = split * SPLIT_BLOCKS * BLOCK_N
    end = tl.minimum(start + SPLIT_BLOCKS * BLOCK_N, S)
    # A constant trip count, not `while start < end`: Triton pipelines only for-loops (num_stages: the next
    # K/V blocks load while this one computes), 21 us against 26 at the best tiles of each on the H200; and
    # the interpreter cannot bound a range by a runtime value. Blocks past `end` (the last split's tail) are
    # masked: no memory traffic, p = 0, only the MMAs run.
    for i in range(SPLIT_BLOCKS):
        cols = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k = tl.load(k_rows + cols[:, None] * stride_kn, mask=col_ok[:, None], other=0.0)
        # ieee: fp32 inputs (the interpreter tests) multiply in fp32, not tf32; bf16/fp16 are unaffected
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * 1.4426950408889634
        s = tl.where(col_ok[None, :], s, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_rows + cols[:, None] * stride_vn, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        row_max = new_max
    out_rows = (split * tl.num_programs(1) + head) * M + rows  # [splits, Hkv, M] row-major
    tl.store(max_ptr + out_rows, row_max, mask=row_ok)
    tl.store(sum_ptr + out_rows, row_sum, mask=row_ok)
    tl.store(acc_ptr + out_rows[:, None] * D + ds[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    o_ptr,
    M,
    T,
    stride_ob,
    stride_oh,
    stride_og,
    stride_ot,
    SPLITS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    # canvas b of a ragged call (`triton_ragged`): its splits' partials, then its own output rows
    b = tl.program_id(2).to(tl.int64)
    acc_ptr += b * SPLITS * heads * M * D
    max_ptr += b * SPLITS * heads * M
    sum_ptr += b * SPLITS * heads * M
    o_ptr += b * stride_ob
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    ds = tl.arange(0, D)
    m_max = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    for i in tl.static_range(SPLITS):
        m_max = tl.maximum(
            m_max, tl.load(max_ptr + (i * heads + head) * M + rows, mask=row_ok, other=-1.0e30)
        )
    num = tl.zeros((BLOCK_R, D), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    for i in tl.static_range(SPLITS):  # in split order: the same sums every run
        split_rows = (i * heads + head) * M + rows
        w = tl.exp2(tl.load(max_ptr + split_rows, mask=row_ok, other=-1.0e30) - m_max)
        den += w * tl.load(sum_ptr + split_rows, mask=row_ok, other=1.0)
        num += w[:, None] * tl.load(
            acc_ptr + split_rows[:, None] * D + ds[None, :], mask=row_ok[:, None], other=0.0
        )
    out = num / den[:, None]
    # row r of a head's M = g * T rows is query t = r % T of its group's head r // T
    dst = o_ptr + head * stride_oh + (rows // T) * stride_og + (rows % T) * stride_ot
    dst = dst[:, None] + ds[None, :]
    tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.cache
def sm_count(device: torch.device) -> int:
    # off CUDA (the interpreter): the H200's
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _auto_splits(programs: int, key_blocks: int, sms: int) -> int:
    """As many splits as fill one wave of one program per SM, each at least MIN_SPLIT_BLOCKS key blocks long,
    none empty (splits of cdiv(key_blocks, splits) blocks may cover the keys in fewer than asked)."""
    splits = max(1, min(sms // programs, key_blocks // MIN_SPLIT_BLOCKS))
    return triton.cdiv(key_blocks, triton.cdiv(key_blocks, splits))


def attention_splitkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    splits: int | None = SPLITS,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    out: torch.Tensor | None = None,
    span: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """softmax(q k^T) v, scale 1, no mask: q [1, Hkv, M, d], k/v [1, Hkv, S, d] (any strides with unit last
    stride; k and v may be slices of one tensor) -> [1, Hkv, M, d] contiguous in q's dtype. splits: key ranges
    per (row block, head), on block_n boundaries; None picks them from the SM count (`_auto_splits`).

    `span` = (int32 [2] on q's device, n_max): the keys are slots span[0] .. span[0] + span[1] of k and v, and
    span[1] <= n_max, read on the device: a CUDA graph of this call serves every span of at most n_max keys
    (the tiling is n_max's; keys past span[1] are masked).

    `out`, when given, receives the result and is returned: a [Hkv, g, T, d] view (g * T = M, q's dtype, unit
    last stride), query row r of a head going to out[head, r // T, r % T]. `cuda.attention_nomask` passes the
    [T, H, d] rows that o_proj reads, so that no copy of the output follows.

    d <= 256 only: at d = 512 (full layers: Hkv 2, M 2048, 4,352 keys) the tiles that compiled took 200 us
    or more on the H200, twice `cuda.attention_nomask`'s 106."""
    if (
        q.dim() != 4
        or q.shape[0] != 1
        or k.shape != v.shape
        or k.shape[:2] != q.shape[:2]
        or k.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"attention_splitkv: want q [1, Hkv, M, d], k/v [1, Hkv, S, d], got {q.shape} {k.shape} {v.shape}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention_splitkv: q, k, v dtypes differ: {q.dtype} {k.dtype} {v.dtype}")
    _, hkv, m_rows, d = q.shape
    s_keys = k.shape[2] if span is None else span[1]
    if span is not None and (
        span[0].dtype != torch.int32
        or span[0].shape != (2,)
        or span[0].device != q.device
        or span[1] > k.shape[2]
    ):
        raise ValueError(
            f"attention_splitkv: span must be (int32 [2] on {q.device}, n_max <= {k.shape[2]} slots), got "
            f"{span[0].dtype} {tuple(span[0].shape)} {span[1]}"
        )
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"attention_splitkv: head_dim must be a power of two in [16, 256], got {d}")
    if s_keys == 0 or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("attention_splitkv: needs at least one key and unit last strides")
    if out is not None and (
        out.dim() != 4
        or out.shape[0] != hkv
        or out.shape[1] * out.shape[2] != m_rows
        or out.shape[3] != d
        or out.dtype != q.dtype
        or out.stride(3) != 1
    ):
        raise ValueError(
            f"attention_splitkv: out must be [Hkv, g, T, d] with g*T = {m_rows} in {q.dtype}, unit last stride; "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    key_blocks = triton.cdiv(s_keys, block_n)
    row_blocks = triton.cdiv(m_rows, block_m)
    if splits is None:
        splits = _auto_splits(row_blocks * hkv, key_blocks, sm_count(q.device))
    f32 = {"device": q.device, "dtype": torch.float32}
    pdl_on = pdl.enabled(q.device)
    acc = torch.empty(splits, hkv, m_rows, d, **f32)
    maxes = torch.empty(splits, hkv, m_rows, **f32)
    sums = torch.empty(splits, hkv, m_rows, **f32)
    # Triton's default fp fusion (unlike triton_qkv): nothing here mirrors an eager op's rounding, the
    # reference kernels sum in their own order, and an FMA in s * log2(e) - max only makes exponents exacter.
    _splitkv_kernel[(row_blocks, hkv, splits)](
        q,
        k,
        v,
        acc,
        maxes,
        sums,
        q if span is None else span[0],  # not read without a span
        m_rows,
        s_keys,
        q.stride(1),
        q.stride(2),
        k.stride(1),
        k.stride(2),
        v.stride(1),
        v.stride(2),
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT_BLOCKS=triton.cdiv(key_blocks, splits),
        HAS_SPAN=span is not None,
        PDL=pdl_on,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl_on,
    )
    result = out if out is not None else torch.empty(1, hkv, m_rows, d, device=q.device, dtype=q.dtype)
    dst = result if out is not None else result.view(hkv, 1, m_rows, d)
    _combine_kernel[(triton.cdiv(m_rows, COMBINE_ROWS), hkv)](
        acc,
        maxes,
        sums,
        dst,
        m_rows,
        dst.shape[2],
        0,
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        SPLITS=splits,
        D=d,
        BLOCK_R=COMBINE_ROWS,
        PDL=pdl_on,
        num_warps=4,
        launch_pdl=pdl_on,
    )
    return result


# Sliding-window prefill tiles: the best of 12 tilings at T = 4,096 (docs/performance.md, "Attention kernels").
# Shared memory: the 64 KB Q tile and 32 KB each of K and V a stage, 192 KB of the 227 KB; 3 stages do not fit.
WINDOW_BLOCK_M = 128
WINDOW_BLOCK_N = 64
WINDOW_NUM_WARPS = 8
WINDOW_NUM_STAGES = 2


# n and T only bound masks: not specialized (n % 16, T % 16), so a model compiles this once per tile.
@triton.jit(do_not_specialize=["n", "T"])
def _window_kernel(
    q_ptr,
    past_ptr,
    chunk_ptr,
    out_ptr,
    n,
    T,
    stride_qh,
    stride_qt,
    stride_pv,
    stride_ph,
    stride_pn,
    stride_cv,
    stride_ch,
    stride_cn,
    stride_ot,
    GROUP: tl.constexpr,
    WINDOW: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
):
    head = tl.program_id(1)
    t0 = tl.program_id(0) * BLOCK_M
    ts = t0 + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    q = tl.load(
        q_ptr + head * stride_qh + ts[:, None] * stride_qt + ds[None, :], mask=(ts < T)[:, None], other=0.0
    )
    past = past_ptr + (head // GROUP) * stride_ph
    chunk = chunk_ptr + (head // GROUP) * stride_ch
    # Key index kj: past slot kj below n, chunk slot kj - n from n on; query t is key n + t. The block's
    # queries see keys first .. end - 1, at most WINDOW - 1 + BLOCK_M of them: NB blocks cover them.
    first = tl.maximum(n + t0 - WINDOW + 1, 0)
    end = tl.minimum(n + t0 + BLOCK_M, n + T)
    row_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite: a row with no key yet never makes inf - inf
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # A constant trip count, as in _splitkv_kernel: pipelined, and runnable by the interpreter. Blocks past
    # `end` (a chunk's first queries, n = 0) load nothing but still run their MMAs.
    for i in range(NB):
        kj = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = kj < end
        # One load a block through selected row pointers, not a load from each side and a select of the values:
        # compiled for sm_90 at the default tiles, 160 KB of shared memory and 92 bytes of spills against 192 KB
        # and 530 bytes. Masked lanes touch no memory.
        in_past = kj < n
        k_rows = tl.where(in_past, past + kj * stride_pn, chunk + (kj - n) * stride_cn)
        v_rows = k_rows + tl.where(in_past, stride_pv, stride_cv)
        k = tl.load(k_rows[:, None] + ds[None, :], mask=key_ok[:, None], other=0.0)
        # ieee: fp32 inputs (the interpreter tests) multiply in fp32, not tf32; bf16/fp16 are unaffected
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * 1.4426950408889634
        behind = (n + ts)[:, None] - kj[None, :]  # causal and window; kj < n + T follows for rows t < T
        s = tl.where((behind >= 0) & (behind < WINDOW), s, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_rows[:, None] + ds[None, :], mask=key_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        row_max = new_max
    out = acc / row_sum[:, None]
    dst = out_ptr + ts[:, None] * stride_ot + head * D + ds[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(ts < T)[:, None])


def attention_window_rows(
    q: torch.Tensor,
    past: torch.Tensor,
    chunk: torch.Tensor,
    window: int,
    block_m: int = WINDOW_BLOCK_M,
    block_n: int = WINDOW_BLOCK_N,
    num_warps: int = WINDOW_NUM_WARPS,
    num_stages: int = WINDOW_NUM_STAGES,
) -> torch.Tensor:
    """Causal sliding-window attention of a prefill chunk, scale 1: query t (position n + t) sees the keys at
    positions p with n + t - window < p <= n + t. q [1, H, T, d]; past [2, Hkv, n, d]: K and V of the
    n <= window - 1 positions before the chunk; chunk [2, Hkv, T, d]: the chunk's own (any strides with unit
    last stride). Returns rows [T, H * d] in q's dtype (o_proj's input: query head h at columns h*d..)."""
    if (
        q.dim() != 4
        or q.shape[0] != 1
        or past.dim() != 4
        or chunk.shape != (2, past.shape[1], q.shape[2], q.shape[3])
        or past.shape[0] != 2
        or past.shape[3] != q.shape[3]
        or q.shape[1] % past.shape[1]
    ):
        raise ValueError(
            "attention_window_rows: want q [1, H, T, d], past [2, Hkv, n, d], chunk [2, Hkv, T, d] with Hkv "
            f"dividing H, got {tuple(q.shape)} {tuple(past.shape)} {tuple(chunk.shape)}"
        )
    if not q.dtype == past.dtype == chunk.dtype:
        raise ValueError(f"attention_window_rows: dtypes differ: {q.dtype} {past.dtype} {chunk.dtype}")
    _, h, t, d = q.shape
    hkv, n = past.shape[1], past.shape[2]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"attention_window_rows: head_dim must be a power of two in [16, 256], got {d}")
    if q.stride(3) != 1 or past.stride(3) != 1 or chunk.stride(3) != 1:
        raise ValueError("attention_window_rows: needs unit last strides")
    if n > window - 1:
        raise ValueError(f"attention_window_rows: {n} past positions, the window sees at most {window - 1}")
    out = torch.empty(t, h * d, device=q.device, dtype=q.dtype)
    _window_kernel[(triton.cdiv(t, block_m), h)](
        q,
        past,
        chunk,
        out,
        n,
        t,
        q.stride(1),
        q.stride(2),
        past.stride(0),
        past.stride(1),
        past.stride(2),
        chunk.stride(0),
        chunk.stride(1),
        chunk.stride(2),
        out.stride(0),
        GROUP=h // hkv,
        WINDOW=window,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NB=triton.cdiv(window - 1 + block_m, block_n),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
