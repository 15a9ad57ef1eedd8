"""What follows the merged q/k/v GEMM of a layer, in one Triton kernel: Q and K rms_norm'd and rotated (RoPE),
V rms_norm'd without scale (on full layers V is the raw K), each written head-major ([heads, T, d]) where
attention and the cache want it.

On an H200 the compiled region doing this (`regions.qkv_post`, three kernels) and the copy of the canvas's K/V into
the cache took 29 us a denoise layer for ~8 MB of traffic; this kernel takes 4 us, 15 with the cos/sin tables
(bench/layer_kernels.py). A program owns BLOCK_T tokens of one head: it reads their [BLOCK_T, d] slice of the
GEMM output and writes it to the head's rows. K and V can go straight into the cache's canvas slots (any
strides with unit last stride).

The math rounds where `torch_ref` does in the activation dtype: the norm's output, x * cos, rotate * sin, and
their sum. cos and sin come in as `torch_ref.rope_cos_sin` tables [T, d], made once per layer type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
NUM_WARPS = 4
# No fused multiply-adds: with them (Triton's default) the compiler turned a bf16-rounded product plus the next
# one into `fma.rn.bf16`, dropping the product's rounding; on an H200 24% of Q's elements came out one rounding
# off the eager ops. tests/test_triton_ptx.py checks the PTX for sm_90; tests/gpu the bits.
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


@triton.jit
def _norm_rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_ptr,
    kv_ptr,
    slot_ptr,
    T,
    eps,
    stride_t,
    stride_ct,
    stride_qh,
    stride_qt,
    stride_kv2,
    stride_kvh,
    stride_kvt,
    table_ptr,
    stride_geo,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    HAS_V: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SLOT: tl.constexpr,
    RAGGED: tl.constexpr,
):
    head = tl.program_id(1)  # 0..NQ-1: Q heads, then NKV K heads, then (HAS_V) NKV V heads
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if (
        RAGGED
    ):  # canvas b of a batched pass (`triton_ragged.norm_rope_ragged`): its rows, its own cache's buffer
        b = tl.program_id(2).to(tl.int64)
        qkv_ptr += b * T * stride_t
        cos_ptr += b * T * stride_ct
        sin_ptr += b * T * stride_ct
        q_ptr += b * NQ * stride_qh
        kv_ptr = tl.load(table_ptr + 2 * b).to(tl.pointer_type(qkv_ptr.dtype.element_ty))
        slots = tl.load(table_ptr + 2 * b + 1)
        stride_kvt = D
        stride_kvh = slots * D
        stride_kv2 = NKV * slots * D
        slot_ptr += b * stride_geo
    # K/V of token t go to slot slot[0] + t, read on the device (a CUDA graph's, any cache length)
    if HAS_SLOT:
        kv_ptr += tl.load(slot_ptr).to(tl.int64) * stride_kvt
    t_ok = (ts < T)[:, None]
    half: tl.constexpr = D // 2
    ds = tl.arange(0, half)
    src = qkv_ptr + ts[:, None].to(tl.int64) * stride_t + head * D + ds[None, :]
    x1 = tl.load(src, mask=t_ok, other=0.0)
    x2 = tl.load(src + half, mask=t_ok, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    n1 = x1 * inv_rms
    n2 = x2 * inv_rms
    # V heads come last; a full layer has none, its V is its raw K (the K heads), rms_norm'd without scale
    v_head = head - NQ - (NKV if HAS_V else 0)
    if v_head >= 0:
        dst = kv_ptr + stride_kv2 + v_head * stride_kvh + ts[:, None] * stride_kvt + ds[None, :]
        tl.store(dst, n1.to(dt), mask=t_ok)
        tl.store(dst + half, n2.to(dt), mask=t_ok)
    if head < NQ + NKV:
        if head < NQ:
            w_ptr = q_norm_ptr
            dst = q_ptr + head * stride_qh + ts[:, None] * stride_qt + ds[None, :]
        else:
            w_ptr = k_norm_ptr
            dst = kv_ptr + (head - NQ) * stride_kvh + ts[:, None] * stride_kvt + ds[None, :]
        y1 = (n1 * tl.load(w_ptr + ds).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        y2 = (n2 * tl.load(w_ptr + half + ds).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        trig = ts[:, None] * stride_ct + ds[None, :]  # the tables repeat their first half: read it once
        c = tl.load(cos_ptr + trig, mask=t_ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + trig, mask=t_ok, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded after each op as the eager ops in the activation dtype are
        a1 = (y1 * c).to(dt).to(tl.float32)
        b1 = (-y2 * s).to(dt).to(tl.float32)
        a2 = (y2 * c).to(dt).to(tl.float32)
        b2 = (y1 * s).to(dt).to(tl.float32)
        tl.store(dst, (a1 + b1).to(dt), mask=t_ok)
        tl.store(dst + half, (a2 + b2).to(dt), mask=t_ok)


def norm_rope(
    qkv: torch.Tensor,
    n_heads: int,
    n_kv: int,
    has_v: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    kv_out: torch.Tensor | None = None,
    kv_slot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (n_heads + n_kv (+ n_kv if has_v)) * d], the merged GEMM's output -> (q [1, n_heads, T, d]
    contiguous, kv [2, n_kv, T, d]): `regions.qkv_post`'s outputs with stacked K and V. `kv_out`: where to write
    K and V (e.g. the cache's canvas slots), else a new tensor. cos/sin: `torch_ref.rope_cos_sin` tables.

    `kv_slot` (int32 [1] on the device): kv_out is a layer's whole cache buffer [2, n_kv, slots, d] and token t's
    K/V go to slot kv_slot[0] + t; the returned kv is then kv_out itself."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (n_heads + n_kv * (2 if has_v else 1))
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("norm_rope: qkv and the cos/sin tables need contiguous rows")
    if d < 2 or d & (d - 1):
        raise ValueError(f"norm_rope: head_dim must be a power of two, got {d}")
    q = torch.empty(n_heads, t, d, device=qkv.device, dtype=qkv.dtype)
    kv = torch.empty(2, n_kv, t, d, device=qkv.device, dtype=qkv.dtype) if kv_out is None else kv_out
    want = (2, n_kv, kv.shape[2] if kv_slot is not None else t, d)
    if (
        kv.shape != want
        or kv.stride(3) != 1
        or kv.dtype != qkv.dtype
        or (kv_slot is not None and kv_out is None)
    ):
        raise ValueError(
            f"norm_rope: kv_out must be [2, {n_kv}, {t} (or the slots with kv_slot), {d}] {qkv.dtype} with unit "
            f"last stride, got {tuple(kv.shape)} {kv.dtype}"
        )
    if kv_slot is not None and (kv_slot.dtype != torch.int32 or kv_slot.numel() != 1):
        raise ValueError(f"norm_rope: kv_slot must be one int32, got {kv_slot.dtype} {tuple(kv_slot.shape)}")
    grid = (triton.cdiv(t, BLOCK_T), n_heads + n_kv * (2 if has_v else 1))
    _norm_rope_kernel[grid](
        qkv,
        cos,
        sin,
        q_norm,
        k_norm,
        q,
        kv,
        kv if kv_slot is None else kv_slot,  # not read without a slot
        t,
        eps,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        q,  # no table: not read
        0,
        NQ=n_heads,
        NKV=n_kv,
        HAS_V=has_v,
        D=d,
        BLOCK_T=BLOCK_T,
        HAS_SLOT=kv_slot is not None,
        RAGGED=False,
        **LAUNCH_OPTIONS,
    )
    return q[None], kv
