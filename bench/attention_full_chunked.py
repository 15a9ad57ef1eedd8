"""Exploration: a full layer's denoise attention (head_dim 512, 2 KV heads, 2,048 folded query rows) over the
keys in chunks, with an online softmax across chunks (flash semantics: P = exp(s - running max) rounded to bf16
before P @ V, the sum and the output rescaled when the max grows, one division at the end). Each chunk's fp32
scores are small enough to stay in L2 between the GEMM that writes them and the kernel that reads them once,
where `cuda.attention_nomask` writes all S scores to HBM and reads them twice. Prints us per layer for
attention_nomask and each (chunk, row blocks) candidate, and max|diff| against attention_nomask.

    python bench/attention_full_chunked.py [--keys 4352,33024,131328]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.kernels import cuda as fast  # noqa: E402

DEV, DT, HEADS, CANVAS, D, HKV = "cuda", torch.bfloat16, 16, 256, 512, 2


@triton.jit
def _chunk_kernel(s_ptr, p_ptr, m_ptr, l_ptr, a_ptr, n_cols, BLOCK: tl.constexpr):
    """One row of a chunk's scores (n_cols <= BLOCK): p = exp(s - m_new) in bf16, l and m updated, alpha =
    exp(m_old - m_new) stored for rescaling the output."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    s = tl.load(s_ptr + row.to(tl.int64) * n_cols + cols, mask=cols < n_cols, other=-float("inf"))
    m_old = tl.load(m_ptr + row)
    m_new = tl.maximum(m_old, tl.max(s, axis=0))
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_old - m_new)
    tl.store(l_ptr + row, tl.load(l_ptr + row) * alpha + tl.sum(p, axis=0))
    tl.store(m_ptr + row, m_new)
    tl.store(a_ptr + row, alpha)
    tl.store(p_ptr + row.to(tl.int64) * n_cols + cols, p.to(p_ptr.dtype.element_ty), mask=cols < n_cols)


def attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, row_blocks: int
) -> torch.Tensor:
    """q [1, H, T, d], k/v [1, Hkv, S, d] -> [1, H, T, d], scale 1."""
    _, h, t, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    qf = q.reshape(hkv, (h // hkv) * t, d)
    rows = qf.shape[1]
    out = torch.empty(hkv, rows, d, device=q.device, dtype=q.dtype)
    rb = rows // row_blocks
    for r0 in range(0, rows, rb):
        qb = qf[:, r0 : r0 + rb]
        m = torch.full((hkv, rb), -1.0e30, device=q.device)  # a finite floor: never inf - inf
        l_sum = torch.zeros(hkv, rb, device=q.device)
        alpha = torch.empty(hkv, rb, device=q.device)
        acc = torch.zeros(hkv, rb, d, device=q.device)
        for j0 in range(0, s_len, chunk):
            kj, vj = k[0, :, j0 : j0 + chunk], v[0, :, j0 : j0 + chunk]
            s = torch.bmm(qb, kj.transpose(1, 2), out_dtype=torch.float32)
            p = torch.empty(s.shape, device=q.device, dtype=v.dtype)
            _chunk_kernel[(hkv * rb,)](s, p, m, l_sum, alpha, s.shape[-1], BLOCK=chunk, num_warps=8)
            pv = torch.bmm(p, vj, out_dtype=torch.float32)
            torch.addcmul(pv, acc, alpha[..., None], out=acc)
        out[:, r0 : r0 + rb] = (acc / l_sum[..., None]).to(q.dtype)
    return out.reshape(1, h, t, d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="1280,4352,33024,131328")
    args = ap.parse_args()
    torch.manual_seed(0)
    for keys in (int(x) for x in args.keys.split(",")):
        q = torch.randn(1, HEADS, CANVAS, D, device=DEV, dtype=DT) * D**-0.25
        k = torch.randn(1, HKV, keys, D, device=DEV, dtype=DT) * D**-0.25
        v = torch.randn(1, HKV, keys, D, device=DEV, dtype=DT)
        want = fast.attention_nomask(q, k, v)
        ref = None
        if keys <= 33024:  # fp64 reference: [2, 2048, S] doubles
            qd = q.double().reshape(HKV, -1, D)
            ref = torch.bmm(torch.softmax(torch.bmm(qd, k[0].double().transpose(1, 2)), -1), v[0].double())
            ref = ref.reshape(q.shape)
        base = time_graph(lambda q=q, k=k, v=v: fast.attention_nomask(q, k, v), calls=4) * 1e3
        err0 = float((want.double() - ref).abs().max()) if ref is not None else float("nan")
        print(f"keys {keys}: attention_nomask {base:8.1f} us  max|diff| to fp64 {err0:.3g}", flush=True)
        for chunk in (1024, 2048, 4096):
            for row_blocks in (1, 2):
                fn = lambda q=q, k=k, v=v, c=chunk, r=row_blocks: attention_chunked(q, k, v, c, r)  # noqa: E731
                got = fn()
                diff = float((got.float() - want.float()).abs().max())
                err = float((got.double() - ref).abs().max()) if ref is not None else float("nan")
                us = time_graph(fn, calls=4) * 1e3
                print(
                    f"  chunk {chunk:5d} row_blocks {row_blocks}: {us:8.1f} us ({base / us:4.2f}x)  "
                    f"max|diff| to nomask {diff:.3g}, to fp64 {err:.3g}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
