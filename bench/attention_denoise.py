"""Microbenchmark of a denoise step's attention, one layer at the real shape (256 canvas queries, 16 heads):
`library.attention_nomask` against SDPA's backends (GQA folded into the rows, or enable_gqa), FlexAttention and
the split-KV Triton kernel (`triton_attn.attention_splitkv` with its module defaults; with --splitkv-sweep
also over a grid of splits and tiles, sliding shape only), for sliding layers (d=256, 8 KV heads, 1,023
cached keys + the canvas) and full layers (d=512, 2 KV heads, at several context lengths; the split-KV kernel
takes d <= 256 and says so there). Each timing is a CUDA graph of 10 calls, the median of 20 replays, per call; max|diff|
is against attention_nomask. Prints a line per candidate; a candidate that has no kernel says so.

    python bench/attention_denoise.py [--full-keys 1280,4352,33024] [--no-flex] [--splitkv-sweep]

A full layer at context c reads c + 256 keys; a sliding layer reads the 1,023 window positions + 256.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.kernels import library  # noqa: E402
from diffgemma.kernels import triton_attn as ta  # noqa: E402

DEV, DT, HEADS, CANVAS = "cuda", torch.bfloat16, 16, 256
BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def run(name: str, fn, want: torch.Tensor) -> None:
    try:
        diff = float((fn().float() - want.float()).abs().max())
        us = time_graph(fn) * 1e3
        print(f"  {name:34s} {us:8.1f} us  max|diff| {diff:.3g}", flush=True)
    except Exception as e:  # noqa: BLE001 - a backend without a kernel for this shape
        print(f"  {name:34s} no kernel: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend, gqa: bool) -> torch.Tensor:
    with sdpa_kernel([backend]):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True)
        hkv, d = k.shape[1], q.shape[-1]
        qf = q.reshape(1, hkv, -1, d)
        return F.scaled_dot_product_attention(qf, k, v, scale=1.0).reshape(q.shape)


def splitkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **tiles) -> torch.Tensor:
    hkv, d = k.shape[1], q.shape[-1]
    return ta.attention_splitkv(q.reshape(1, hkv, -1, d), k, v, **tiles).reshape(q.shape)


def splitkv_sweep(hd: int, hkv: int) -> list[dict]:
    """54 of the grid's 96 configurations: an fp32 accumulator of at most 128 registers a thread (block_m 128
    wants 8 warps) and 64 to 256 programs (a half to two waves of one program per SM)."""
    names = ("splits", "block_m", "block_n", "num_warps", "num_stages")
    configs = []
    for values in itertools.product((1, 2, 4, 8), (64, 128), (32, 64), (4, 8), (1, 2, 3)):
        c = dict(zip(names, values, strict=True))
        programs = triton.cdiv(CANVAS * HEADS // hkv, c["block_m"]) * hkv * c["splits"]
        if c["block_m"] * hd // (32 * c["num_warps"]) <= 128 and 64 <= programs <= 256:
            configs.append(c)
    return configs


def bench_shape(hd: int, hkv: int, keys: int, flex, sweep: bool) -> None:
    print(f"d={hd} kv_heads={hkv} keys={keys}", flush=True)
    q = torch.randn(1, HEADS, CANVAS, hd, device=DEV, dtype=DT) * hd**-0.25
    k = torch.randn(1, hkv, keys, hd, device=DEV, dtype=DT) * hd**-0.25
    v = torch.randn(1, hkv, keys, hd, device=DEV, dtype=DT)
    want = library.attention_nomask(q, k, v)
    run("attention_nomask (in use)", lambda: library.attention_nomask(q, k, v), want)
    for backend in BACKENDS:
        for gqa in (False, True):
            label = f"sdpa {'enable_gqa' if gqa else 'folded'} {backend.name}"
            run(label, lambda backend=backend, gqa=gqa: sdpa(q, k, v, backend, gqa), want)
    if flex is not None:
        run("flex_attention (enable_gqa)", lambda: flex(q, k, v, scale=1.0, enable_gqa=True), want)
    run("triton splitkv (module defaults)", lambda: splitkv(q, k, v), want)
    for tiles in splitkv_sweep(hd, hkv) if sweep and hd == 256 else ():
        label = "triton splitkv s{splits} m{block_m} n{block_n} w{num_warps} st{num_stages}".format(**tiles)
        run(label, lambda tiles=tiles: splitkv(q, k, v, **tiles), want)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--full-keys", default="1280,2304,4352,8448,33024")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument(
        "--splitkv-sweep", action="store_true", help="time a grid of split-KV tiles (sliding shape)"
    )
    args = p.parse_args()
    torch.manual_seed(0)
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    bench_shape(256, 8, 1023 + CANVAS, flex, args.splitkv_sweep)
    for keys in (int(x) for x in args.full_keys.split(",")):
        bench_shape(512, 2, keys, flex, args.splitkv_sweep)


if __name__ == "__main__":
    main()
