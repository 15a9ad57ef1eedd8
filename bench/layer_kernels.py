"""Microbenchmark of the small per-layer work that has its own Triton kernel: the router's top-k and expert
sort (`triton_route.route_sort` against the compiled `regions.route` region), the Q/K/V norms with RoPE
(`triton_qkv.norm_rope` against the compiled `regions.qkv_post` region plus its copy into the cache) and the
combine (`triton_combine.post_ffn` against the compiled `regions.post_ffn`), at a
denoise step's 256 rows and a prefill chunk's 4096, real shapes, bf16. Each timing is a CUDA graph of 10 calls,
the median of 20 replays, per call. Results go to $OUT/layer_kernels.json when OUT is set.

    python bench/layer_kernels.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench.report import write_json  # noqa: E402
from diffgemma.kernels import regions as compiled  # noqa: E402
from diffgemma.kernels import torch_ref as ref  # noqa: E402
from diffgemma.kernels import triton_combine as tc  # noqa: E402
from diffgemma.kernels import triton_qkv as tq  # noqa: E402
from diffgemma.kernels import triton_route as tr  # noqa: E402

DEV = "cuda"


def bench_route(regions: dict, n: int) -> dict:
    logits = (torch.randn(n, 128, device=DEV) * 2).bfloat16()
    pes = torch.rand(128, device=DEV) + 0.5
    region = time_graph(lambda: regions["route"](logits, pes, 8)) * 1e3
    kernel = time_graph(lambda: tr.route_sort(logits, pes, 8)) * 1e3
    print(f"route n={n:5d}: region {region:7.1f} us, triton {kernel:7.1f} us", flush=True)
    # the kernels' rows a program and warps (module settings read at each call)
    tiles = {}
    default = (tr.block_rows, tr.NUM_WARPS)
    for rows, warps in [(r, w) for r in (4, 8, 16, 32) for w in (1, 2, 4)]:
        tr.block_rows, tr.NUM_WARPS = (lambda _n, r=rows: r), warps
        tiles[f"rows{rows}_warps{warps}"] = us = time_graph(lambda: tr.route_sort(logits, pes, 8)) * 1e3
        print(f"  route n={n:5d} block_rows {rows:2d} warps {warps}: {us:7.1f} us", flush=True)
    tr.block_rows, tr.NUM_WARPS = default
    return {"op": "route", "rows": n, "region_us": region, "triton_us": kernel, "triton_tiles_us": tiles}


def bench_qkv(regions: dict, hd: int, nkv: int, has_v: bool, rope: tuple, t: int) -> dict:
    heads = 16 + nkv * (2 if has_v else 1)
    qkv = torch.randn(t, heads * hd, device=DEV).bfloat16()
    qn, kn = torch.ones(hd, device=DEV).bfloat16(), torch.ones(hd, device=DEV).bfloat16()
    inv = ref.rope_inv_freq(hd, *rope).to(DEV)
    pos = torch.arange(1000, 1000 + t, device=DEV)
    dst = torch.zeros(2, nkv, t + 500, hd, device=DEV, dtype=torch.bfloat16)[:, :, 100 : 100 + t]
    q3, k3 = qkv[:, : 16 * hd].view(t, 16, hd), qkv[:, 16 * hd : (16 + nkv) * hd].view(t, nkv, hd)
    v3 = qkv[:, (16 + nkv) * hd :].view(t, nkv, hd) if has_v else None
    cos, sin = ref.rope_cos_sin(inv, pos, torch.bfloat16)

    def region():
        dst.copy_(regions["qkv_post"](q3, k3, v3, qn, kn, inv, pos, 1e-6, True)[1])

    def kernel(tables: bool):
        c, s = ref.rope_cos_sin(inv, pos, torch.bfloat16) if tables else (cos, sin)  # once a layer type
        tq.norm_rope(qkv, 16, nkv, has_v, c, s, qn, kn, 1e-6, dst)

    r_us = time_graph(region) * 1e3
    k_us = time_graph(lambda: kernel(True)) * 1e3
    alone = time_graph(lambda: kernel(False)) * 1e3
    print(
        f"qkv_post d={hd} t={t:5d}: region + copy {r_us:7.1f} us, triton + tables {k_us:7.1f} us, "
        f"triton alone {alone:7.1f} us",
        flush=True,
    )
    return {
        "op": "qkv_post",
        "head_dim": hd,
        "rows": t,
        "region_us": r_us,
        "triton_us": k_us,
        "alone_us": alone,
    }


def bench_combine(regions: dict, n: int) -> dict:
    k, hid, dt = 8, 2816, torch.bfloat16
    h, dense = torch.randn(n, hid, device=DEV).to(dt), torch.randn(n, hid, device=DEV).to(dt)
    w = torch.rand(n, k, device=DEV)
    slot = torch.randperm(n * k, device=DEV)
    y = torch.randn(n * k, hid, device=DEV).to(dt)
    norms = [torch.ones(hid, device=DEV, dtype=dt) for _ in range(3)]
    args = (
        h,
        dense,
        y,
        slot,
        w,
        norms[0],
        norms[1],
        torch.ones(1, device=DEV, dtype=dt),
        norms[2],
        1e-6,
    )
    region = time_graph(lambda: regions["post_ffn"](*args)) * 1e3
    kernel = time_graph(lambda: tc.post_ffn(*args)) * 1e3
    print(f"post_ffn n={n:5d}: region {region:7.1f} us, triton {kernel:7.1f} us", flush=True)
    return {"op": "post_ffn", "rows": n, "region_us": region, "triton_us": kernel}


def main() -> None:
    regions = compiled.make_regions()
    results = [bench_route(regions, n) for n in (256, 4096)]
    for kind in ((256, 8, True, (1e4, "default", 1.0)), (512, 2, False, (1e6, "proportional", 0.25))):
        results += [bench_qkv(regions, *kind, t) for t in (256, 4096)]
    results += [bench_combine(regions, n) for n in (256, 4096)]
    out = os.environ.get("OUT")
    if out:
        doc = {"device": torch.cuda.get_device_name(), "results": results}
        write_json(Path(out, "layer_kernels.json"), doc, indent=1)


if __name__ == "__main__":
    main()
