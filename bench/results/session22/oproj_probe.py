# ruff: noqa: B023 - each lambda is timed at once, inside its loop iteration
"""Session 22 probe: o_proj ([256, K] @ W[2816, K].T, K = 4,096 sliding / 8,192 full) as a Triton split-K GEMM
(fp32 partials, then a sum over the splits) against cuBLAS's F.linear, in CUDA graphs of 20 calls."""

import itertools
import statistics
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _splitk_kernel(
    a_ptr, b_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_PER: tl.constexpr
):
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for i in tl.range(0, K_PER // BK):
        ks = ps * K_PER + i * BK + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
        b = tl.load(b_ptr + cols[:, None] * K + ks[None, :])
        acc += tl.dot(a, tl.trans(b))
    tl.store(out_ptr + (ps * M + rows)[:, None] * N + cols[None, :], acc, mask=(cols < N)[None, :])


@triton.jit
def _sum_kernel(p_ptr, out_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for i in tl.static_range(1, S):
        acc += tl.load(p_ptr + i * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def splitk(a, b, bm, bn, bk, s, warps, stages, parts=None, out=None):
    m, k = a.shape
    n = b.shape[0]
    parts = torch.empty(s, m, n, device=a.device, dtype=torch.float32) if parts is None else parts
    out = torch.empty(m, n, device=a.device, dtype=a.dtype) if out is None else out
    _splitk_kernel[(m // bm, triton.cdiv(n, bn), s)](
        a, b, parts, m, n, k, BM=bm, BN=bn, BK=bk, K_PER=k // s, num_warps=warps, num_stages=stages
    )
    _sum_kernel[(triton.cdiv(m * n, 1024),)](parts, out, m * n, S=s, BLOCK=1024)
    return out


def graph_us(fn, calls=20):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    ms = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(ms)


dev = "cpu" if len(sys.argv) > 1 and sys.argv[1] == "cpu" else "cuda"
if dev == "cpu":  # the interpreter: correctness only, small shapes, fp16
    a, b = torch.randn(64, 256).half(), torch.randn(96, 256).half()
    got = splitk(a, b, 32, 32, 32, 2, 4, 2)
    print("interpreter max |d|", (got.float() - a.float() @ b.float().T).abs().max().item())
    sys.exit()
for k in (4096,):
    a = torch.randn(256, k, device=dev).bfloat16()
    b = (torch.randn(2816, k, device=dev) * k**-0.5).bfloat16()
    lib = torch.nn.functional.linear(a, b)
    print(f"K {k}: cuBLAS {graph_us(lambda: torch.nn.functional.linear(a, b)):.1f} us", flush=True)
    res = []
    for bm, bn, bk, s, warps, stages in itertools.product(
        (64, 128), (64, 128), (64, 128), (2, 4), (4, 8), (3, 4)
    ):
        if bm * bn > 128 * 64 and warps == 4 or (bk == 128 and stages == 4 and bm * bn > 64 * 64):
            continue
        try:
            parts = torch.empty(s, 256, 2816, device=dev, dtype=torch.float32)
            out = torch.empty(256, 2816, device=dev, dtype=torch.bfloat16)
            got = splitk(a, b, bm, bn, bk, s, warps, stages, parts, out)
            err = ((got.float() - lib.float()).abs().max() / lib.float().abs().max()).item()
            us = graph_us(lambda: splitk(a, b, bm, bn, bk, s, warps, stages, parts, out))
            res.append((us, (bm, bn, bk, s, warps, stages), err))
        except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it
            print("skip", (bm, bn, bk, s, warps, stages), type(e).__name__, flush=True)
    for us, cfg, err in sorted(res)[:6]:
        print(f"K {k}: {cfg} {us:.1f} us (rel err {err:.1e})", flush=True)
