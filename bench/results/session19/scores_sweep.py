"""Ran in session 19's calls 3-4 with `scores_kernel.diff` applied (not kept), where `cuda.softmax_to` still existed. A full layer's denoise attention (2 KV heads, 2,048 folded query rows, head_dim 512, keys in the cache's
buffer with a device-side valid count, as in the graph): the path in use (cuBLAS scores in fp32, the two-read
Triton softmax, cuBLAS P @ V) against the Triton scores kernel that also writes each tile's row max and sum,
so that the softmax reads the scores once (`triton_softmax.scores`, `softmax_rows(stats=)`), for several tiles.
us per layer (graphs of 4 calls, bench/moe_kernels.time_graph), and max|diff| of P and of the output."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import time_graph  # noqa: E402

from diffgemma.kernels import cuda as fast  # noqa: E402
from diffgemma.kernels import triton_softmax as ts  # noqa: E402

B = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
TILES = {
    "w4_s3": B,
    "w4_s3 stats max only": {**B, "stats": 1},
    "w4_s3 no stats": {**B, "stats": 0},
    "w4_s3 tma store": {**B, "store_tma": True},
    "w4_s3 p1": {**B, "persistent": 1},
    "w4_s3 p2": {**B, "persistent": 2},
    "w4_s3 p1 tma store": {**B, "persistent": 1, "store_tma": True},
    "w4_s4 p1 tma store": {**B, "num_stages": 4, "persistent": 1, "store_tma": True},
    "w4_s2 p2 tma store": {**B, "num_stages": 2, "persistent": 2, "store_tma": True},
    "n256_w8_s3 p1": {**B, "BLOCK_N": 256, "num_warps": 8, "persistent": 1},
    "n256_w8_s3": {**B, "BLOCK_N": 256, "num_warps": 8},
}
g = torch.Generator(device="cuda").manual_seed(0)
HKV, ROWS, D = 2, 2048, 512


def run(ctx: int) -> None:
    valid_n = ctx + 256
    full = -(-valid_n // 1024) * 1024
    buf = torch.randn(2, HKV, full + 512, D, generator=g, device="cuda", dtype=torch.bfloat16) * 0.15
    q = torch.randn(HKV, ROWS, D, generator=g, device="cuda", dtype=torch.bfloat16) * 0.15
    k, v = buf[0, :, :full], buf[1, :, :full]
    valid = torch.tensor([valid_n], device="cuda", dtype=torch.int32)

    def in_use():
        s = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
        return torch.bmm(fast.softmax_to(s, torch.bfloat16, valid=valid), v)

    s0 = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    p0 = fast.softmax_to(s0, torch.bfloat16, valid=valid)
    out0 = in_use()
    base = time_graph(in_use, calls=4) * 1e3
    t_s = time_graph(lambda: torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32), calls=4) * 1e3
    t_p = time_graph(lambda: fast.softmax_to(s0, torch.bfloat16, valid=valid), calls=4) * 1e3
    print(
        f"ctx {ctx} (keys {full}, valid {valid_n}): in use {base:7.1f} us (scores {t_s:.1f}, softmax {t_p:.1f})"
    )
    for name, tiles in TILES.items():
        try:
            s1, stats = ts.scores(q, k, valid, tiles)
            t1 = time_graph(lambda t=tiles: ts.scores(q, k, valid, t), calls=4) * 1e3
            ds = float((s1[..., :valid_n] - s0[..., :valid_n]).abs().max())
            if tiles.get("stats", 2) < 2:
                print(f"  {name:22s} scores {t1:7.1f}  max|d| s {ds:.2g}", flush=True)
                continue
            p1 = ts.softmax_rows(s1, torch.bfloat16, valid=valid, stats=stats)
            out1 = torch.bmm(p1, v)
            dp = float((p1.float() - p0.float()).abs().max())
            do = float((out1.float() - out0.float()).abs().max())
            t2 = time_graph(
                lambda s=s1, st=stats: ts.softmax_rows(s, torch.bfloat16, valid=valid, stats=st), calls=4
            )

            def whole(t=tiles):
                s, st = ts.scores(q, k, valid, t)
                return torch.bmm(ts.softmax_rows(s, torch.bfloat16, valid=valid, stats=st), v)

            tw = time_graph(whole, calls=4) * 1e3
            print(
                f"  {name:22s} whole {tw:7.1f} us ({tw / base:.3f}x)  scores {t1:7.1f}  softmax {t2 * 1e3:7.1f}"
                f"  max|d| s {ds:.2g} p {dp:.2g} out {do:.2g}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            print(f"  {name:22s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


for ctx in (1024, 32768, 131072):
    run(ctx)
    torch.cuda.empty_cache()
