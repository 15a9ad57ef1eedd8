"""Full-layer denoise attention (d=512, 2 kv heads, M = 8 * 256 folded rows) candidates against the current
materialized path: (a) split-KV flash kernels at d=512 in several tilings, (b) the materialized path with a
one-read softmax (the row held on chip). Graph-timed; error against an fp32 reference."""

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "src")
sys.path.insert(0, "bench")
from moe_kernels import time_graph  # noqa: E402

from diffgemma.kernels import cuda as fast  # noqa: E402
from diffgemma.kernels import triton_attn as ta  # noqa: E402

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16


@triton.jit
def _softmax_row1_kernel(x_ptr, y_ptr, valid_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    limit = tl.minimum(n_cols, tl.load(valid_ptr))
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < limit, other=-float("inf"))
    m = tl.max(x, axis=0)
    p = tl.exp(x - m)
    p = p * (1.0 / tl.sum(p, axis=0))
    tl.store(y_ptr + row.to(tl.int64) * stride_y + cols, p.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


def materialized_row1(qf, k, v, valid, warps):
    scores = torch.bmm(qf[0], k[0].transpose(1, 2), out_dtype=torch.float32)
    rows = scores.reshape(-1, scores.shape[-1])
    p = torch.empty(rows.shape, device=dev, dtype=v.dtype)
    block = triton.next_power_of_2(rows.shape[1])
    _softmax_row1_kernel[(rows.shape[0],)](
        rows, p, valid, rows.shape[1], rows.stride(0), p.stride(0), BLOCK=block, num_warps=warps
    )
    return torch.bmm(p.view(scores.shape), v[0])


def flash(qf, k, v, span, splits, bm, bn, warps, stages):
    hkv, m_rows, d = qf.shape[1], qf.shape[2], qf.shape[3]
    s_keys = span[1]
    key_blocks = triton.cdiv(s_keys, bn)
    row_blocks = triton.cdiv(m_rows, bm)
    if splits is None:
        splits = ta._auto_splits(row_blocks * hkv, key_blocks, ta._sm_count(qf.device))
    f32 = {"device": dev, "dtype": torch.float32}
    acc = torch.empty(splits, hkv, m_rows, d, **f32)
    maxes = torch.empty(splits, hkv, m_rows, **f32)
    sums = torch.empty(splits, hkv, m_rows, **f32)
    ta._splitkv_kernel[(row_blocks, hkv, splits)](
        qf, k, v, acc, maxes, sums, span[0], m_rows, s_keys,
        qf.stride(1), qf.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        D=d, BLOCK_M=bm, BLOCK_N=bn, SPLIT_BLOCKS=triton.cdiv(key_blocks, splits), HAS_SPAN=True, PDL=False,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = torch.empty(1, hkv, m_rows, d, device=dev, dtype=qf.dtype)
    dst = out.view(hkv, 1, m_rows, d)
    ta._combine_kernel[(triton.cdiv(m_rows, 16), hkv)](
        acc, maxes, sums, dst, m_rows, m_rows, dst.stride(0), dst.stride(1), dst.stride(2),
        SPLITS=splits, D=d, BLOCK_R=16, PDL=False, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _chunk_softmax_kernel(
    s_ptr, p_ptr, max_ptr, sum_ptr, valid_ptr, M, n_chunks, first_chunk, stride_sh, stride_sm, C: tl.constexpr
):
    """S [hkv, M, g*C] fp32 (chunks first_chunk .. + g) -> P [hkv, n_chunks, M, C] bf16 = exp2(s*log2e - m),
    m (log2 units) and l = sum(p) per (head, chunk, row) in [hkv, n_chunks, M]."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    head = tl.program_id(2)
    chunk = first_chunk + j
    cols = tl.arange(0, C)
    ok = chunk * C + cols < tl.load(valid_ptr)
    x = tl.load(s_ptr + head * stride_sh + row.to(tl.int64) * stride_sm + j * C + cols, mask=ok, other=0.0)
    x = tl.where(ok, x * 1.4426950408889634, -float("inf"))
    m = tl.maximum(tl.max(x, axis=0), -1.0e30)
    p = tl.exp2(x - m)
    out = (head * n_chunks + chunk) * M + row
    tl.store(p_ptr + out.to(tl.int64) * C + cols, p.to(p_ptr.dtype.element_ty))
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(p, axis=0))


@triton.jit
def _chunk_combine_kernel(
    acc_ptr, max_ptr, sum_ptr, o_ptr, M, n_chunks: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr
):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ds = tl.arange(0, D)
    m_max = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    for i in range(n_chunks):
        m_max = tl.maximum(m_max, tl.load(max_ptr + (head * n_chunks + i) * M + rows))
    num = tl.zeros((BLOCK_R, D), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    for i in range(n_chunks):
        r = (head * n_chunks + i) * M + rows
        w = tl.exp2(tl.load(max_ptr + r) - m_max)
        den += w * tl.load(sum_ptr + r)
        num += w[:, None] * tl.load(acc_ptr + r.to(tl.int64)[:, None] * D + ds[None, :])
    tl.store(
        o_ptr + (head * M + rows)[:, None] * D + ds[None, :], (num / den[:, None]).to(o_ptr.dtype.element_ty)
    )


def chunked(qf, k, v, valid, C, G):
    """S in key chunks of C (G chunks a QK GEMM, meant to stay in L2), P per chunk with its own max, one batched
    P @ V over (head, chunk) into fp32 partials, merged like split-KV."""
    hkv, M, d = qf.shape[1], qf.shape[2], qf.shape[3]
    slots = k.shape[2]
    nc = slots // C
    p = torch.empty(hkv, nc, M, C, device=dev, dtype=v.dtype)
    mx = torch.empty(hkv, nc, M, device=dev, dtype=torch.float32)
    sm = torch.empty_like(mx)
    for c0 in range(0, nc, G):
        g = min(G, nc - c0)
        s = torch.bmm(qf[0], k[0, :, c0 * C : (c0 + g) * C].transpose(1, 2), out_dtype=torch.float32)
        _chunk_softmax_kernel[(M, g, hkv)](
            s, p, mx, sm, valid, M, nc, c0, s.stride(0), s.stride(1), C=C, num_warps=4
        )
    acc = torch.bmm(p.view(hkv * nc, M, C), v[0].reshape(hkv * nc, C, d), out_dtype=torch.float32)
    out = torch.empty(1, hkv, M, d, device=dev, dtype=qf.dtype)
    _chunk_combine_kernel[(M // 16, hkv)](acc, mx, sm, out, M, nc, D=d, BLOCK_R=16, num_warps=4)
    return out


def run(name, fn, truth, want):
    try:
        out = fn().float().reshape(truth.shape)
        err = (out - truth).abs()
        diff = float((out - want).abs().max())
        us = time_graph(fn) * 1e3
        print(
            f"  {name:44s} {us:8.1f} us  err max {float(err.max()):.3g} mean {float(err.mean()):.3g}"
            f"  max|diff| vs current {diff:.3g}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        print(f"  {name:44s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)


FLASH = False  # True in device call 1 (the flash tilings and the one-read softmax), False in call 2
hd, hkv, m = 512, 2, 2048
configs = [  # splits, block_m, block_n, warps, stages
    (None, 64, 32, 8, 2),
    (None, 64, 64, 8, 1),
    (None, 64, 32, 8, 1),
    (None, 64, 16, 8, 2),
    (None, 64, 32, 4, 2),
    (None, 128, 32, 8, 1),
]


def measure(s: int) -> None:
    slots = ((s + 1023) // 1024) * 1024  # the graph's full-key bucket: keys past `valid` masked
    print(f"d={hd} hkv={hkv} rows={m} keys={s} of {slots} slots", flush=True)
    qf = torch.randn(1, hkv, m, hd, device=dev, dtype=dt) * hd**-0.25
    kv = torch.randn(2, hkv, slots, hd, device=dev, dtype=dt)
    k, v = kv[0:1], kv[1:2]
    k.mul_(hd**-0.25)
    valid = torch.tensor([s], device=dev, dtype=torch.int32)
    span = torch.tensor([0, s], device=dev, dtype=torch.int32)
    truth = torch.softmax(qf[0].float() @ k[0, :, :s].float().transpose(1, 2), -1) @ v[0, :, :s].float()
    want = fast.attention_nomask(qf, k, v, valid=valid).float().reshape(truth.shape)
    run(
        "current (materialized, 2-read softmax)",
        lambda: fast.attention_nomask(qf, k, v, valid=valid),
        truth,
        want,
    )
    for w in (8, 16, 32) if FLASH else ():
        run(
            f"materialized, 1-read softmax, {w} warps",
            lambda w=w: materialized_row1(qf, k, v, valid, w),
            truth,
            want,
        )
    for c, g in ((1024, 1), (1024, 2), (2048, 1), (512, 2)):
        if slots % c == 0:
            run(f"chunked C={c} G={g}", lambda c=c, g=g: chunked(qf, k, v, valid, c, g), truth, want)
    for cfg in configs if FLASH else ():
        run(f"flash splits={cfg[0]} bm={cfg[1]} bn={cfg[2]} w={cfg[3]} st={cfg[4]}",
            lambda cfg=cfg: flash(qf, k, v, (span, s), *cfg), truth, want)  # fmt: skip


for s in [int(a) for a in sys.argv[1:]] or [1280, 4352, 33024, 131328]:
    measure(s)
    torch.cuda.empty_cache()
