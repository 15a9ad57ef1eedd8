"""The end of a layer's FFN half (`regions.post_ffn`) as one Triton kernel: the sum of each row's k expert outputs,
the three norms, the residual, the layer scalar and the next layer's input norm, a program per row with the whole
row in registers, so that the expert outputs are read once.

The compiled region does the same in one inductor kernel that loops over the row once per norm. This kernel
rounds where the eager ops of `regions.post_ffn` do (fp32 sums, each op's result in the activation dtype) and is
launched without fused multiply-adds (they would skip those roundings, as in `triton_qkv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


@triton.jit
def _rms(x, w_ptr, cols, col_ok, eps, H: tl.constexpr):
    """rms_norm(x) * w in fp32 as torch_ref computes it (x / sqrt(mean(x^2) + eps), times w); not rounded."""
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
    return x * inv * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _post_ffn_kernel(
    h_ptr,
    dense_ptr,
    y_ptr,
    slot_ptr,
    weights_ptr,
    w2_ptr,
    w1_ptr,
    scalar_ptr,
    wn_ptr,
    h_out_ptr,
    x_out_ptr,
    eps,
    K: tl.constexpr,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NEXT: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    dt = h_ptr.dtype.element_ty
    moe = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(K):  # the experts' rows in sorted order: gathered by slot, weighted in fp32
        src = tl.load(slot_ptr + row * K + j)
        term = tl.load(y_ptr + src * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        term = term * tl.load(weights_ptr + row * K + j).to(tl.float32)
        moe = moe + term
    moe = moe.to(dt).to(tl.float32)
    moe = _rms(moe, w2_ptr, cols, col_ok, eps, H).to(dt).to(tl.float32)
    dense = tl.load(dense_ptr + row * H + cols, mask=col_ok, other=0.0).to(tl.float32)
    s = (dense + moe).to(dt).to(tl.float32)
    s = _rms(s, w1_ptr, cols, col_ok, eps, H).to(dt).to(tl.float32)
    h = tl.load(h_ptr + row * H + cols, mask=col_ok, other=0.0).to(tl.float32)
    h = (h + s).to(dt).to(tl.float32)
    h = (h * tl.load(scalar_ptr).to(dt).to(tl.float32)).to(dt)
    tl.store(h_out_ptr + row * H + cols, h, mask=col_ok)
    if HAS_NEXT:
        x = _rms(h.to(tl.float32), wn_ptr, cols, col_ok, eps, H).to(dt)
        tl.store(x_out_ptr + row * H + cols, x, mask=col_ok)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`regions.post_ffn` (same arguments, same results) as one kernel. h, dense [N, H] contiguous in the
    activation dtype; y [N*k, H]; slot, weights [N, k] (or flat)."""
    n, hid = h.shape
    k = weights.shape[-1] if weights.dim() == 2 else weights.numel() // n
    for name, t in (("h", h), ("dense", dense), ("y", y)):
        if not t.is_contiguous():
            raise ValueError(f"post_ffn: {name} must be contiguous")
    h_out = torch.empty_like(h)
    x_out = torch.empty_like(h) if w_next is not None else h_out
    _post_ffn_kernel[(n,)](
        h,
        dense,
        y,
        slot.contiguous(),
        weights.contiguous(),
        w_post_ff2,
        w_post_ff,
        scalar,
        w_post_ff2 if w_next is None else w_next,
        h_out,
        x_out,
        eps,
        K=k,
        H=hid,
        BLOCK_H=triton.next_power_of_2(hid),
        HAS_NEXT=w_next is not None,
        **LAUNCH_OPTIONS,
    )
    return h_out, None if w_next is None else x_out
