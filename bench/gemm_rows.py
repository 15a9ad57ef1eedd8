"""Microbenchmark of a denoise step's 256-row GEMMs (y = x @ W^T, bf16, fp32 accumulation) at the real shapes:
cuBLAS through F.linear, cuBLAS on the transposed problem (W @ x^T), and a Triton split-K candidate (fp32
partials summed in a fixed order, then one rounding to bf16). Each call reads another copy of W (8 copies, more
than the 50 MB L2 holds), so the weight comes from HBM as in a step. Prints us and TB/s of weight read per
candidate; `--out FILE` writes JSON.

    python bench/gemm_rows.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

DEV, DT, ROWS, COPIES = "cuda", torch.bfloat16, 256, 8
# (name, N, K) of the real shape: hidden 2816, 16 heads, sliding d=256 / 8 KV heads, full d=512 / 2 KV heads with
# K = V, dense MLP 2112, 128 experts; the full layers' o_proj reads 16 * 512 columns.
SHAPES = [
    ("qkv sliding", 8192, 2816),
    ("qkv full", 9216, 2816),
    ("o_proj sliding", 2816, 4096),
    ("o_proj full", 2816, 8192),
    ("dense gate_up", 4224, 2816),
    ("dense down", 2816, 2112),
    ("router", 128, 2816),
]


@triton.jit
def _splitk_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    k0 = split * k_per_split
    for kk in range(0, k_per_split, BK):
        rk = k0 + kk + tl.arange(0, BK)
        a = tl.load(
            x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
        )
        b = tl.load(
            w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0
        )
        acc = tl.dot(a, tl.trans(b), acc)
    out = out_ptr + split.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLITS):  # a fixed order: the same bits every call
        acc += tl.load(p_ptr + s * MN + offs, mask=offs < MN, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < MN)


def linear_splitk(
    x: torch.Tensor, w: torch.Tensor, bm: int, bn: int, bk: int, splits: int, warps: int, stages: int
):
    m, k = x.shape
    n = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), splits)
    if splits == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _splitk_kernel[grid](
            x, w, out, m, n, k, k_per_split, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages
        )
        return out
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    _splitk_kernel[grid](
        x, w, part, m, n, k, k_per_split, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages
    )
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLITS=splits, BLOCK=1024)
    return out


def rotating(fn, ws: list[torch.Tensor]):
    """fn(w) over the copies in turn, one per call."""
    state = {"i": 0}

    def call():
        w = ws[state["i"] % len(ws)]
        state["i"] += 1
        return fn(w)

    return call


def bench_shape(name: str, n: int, k: int, configs: list[tuple[int, ...]]) -> dict:
    x = torch.randn(ROWS, k, device=DEV, dtype=DT)
    ws = [torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(COPIES)]
    want = F.linear(x.double(), ws[0].double())
    gb = n * k * 2 / 1e9
    row = {}

    def report(label: str, fn) -> None:
        try:
            err = float((fn(ws[0]).double() - want).abs().max())
            # the graph holds calls per copy, so replays cycle through all copies in a fixed order
            ms = time_graph(rotating(fn, ws), calls=COPIES * 2)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile
            print(f"  {label:40s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
            return
        row[label] = {"us": ms * 1e3, "tb_s": gb / ms, "max_err": err}
        print(f"  {label:40s} {ms * 1e3:7.2f} us  {gb / ms:5.2f} TB/s  max|err| {err:.3g}", flush=True)

    print(f"{name}: M={ROWS} N={n} K={k} ({gb * 1e3:.1f} MB of weight)", flush=True)
    report("F.linear", lambda w: F.linear(x, w))
    report("mm(W, x^T)^T", lambda w: torch.mm(w, x.t()).t())
    for c in configs:
        report("triton bm{} bn{} bk{} split{} w{} s{}".format(*c), lambda w, c=c: linear_splitk(x, w, *c))
    tri = [(v["us"], lbl) for lbl, v in row.items() if lbl.startswith("triton")]
    if tri and "F.linear" in row:
        us, lbl = min(tri)
        print(f"  best: {lbl} {us:.2f} us against F.linear {row['F.linear']['us']:.2f} us", flush=True)
    return {"n": n, "k": k, "rows": ROWS, "candidates": row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="sweep the Triton tiles (else a few)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        tiles = itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4))
        configs = [(bm, bn, bk, s, 4 if bm == 64 else 8, 4) for bm, bn, bk, s in tiles]
    else:
        configs = [
            (64, 128, 128, 2, 4, 4),
            (128, 128, 64, 2, 8, 4),
            (64, 64, 128, 1, 4, 4),
            (128, 64, 128, 3, 4, 3),
        ]
    results = {name: bench_shape(name, n, k, configs) for name, n, k in SHAPES}
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "shapes": results}, indent=1)
        )


if __name__ == "__main__":
    main()
