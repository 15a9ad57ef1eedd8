"""Microbenchmark of a prefill chunk's sliding-window attention, one layer at the real shape (T = 4,096
queries, 16 heads, 8 KV heads, d = 256, window 1,024) after n = 0 (the first chunk) and n = 1,023 cached
positions (past a strided view of a longer cache, as the model passes it): `library.attention_window`'s SDPA path
(its buffer copies, cuDNN with the additive mask, the permute into rows) against the Triton kernel
`triton_attn.attention_window_rows` at the module defaults and, with --sweep, over a grid of tiles. Each
timing is a CUDA graph of 10 calls, the median of 20 replays, per call; max|diff| is against the SDPA path.
Prints a line per candidate; `--out FILE` writes JSON.

    python bench/attention_prefill_window.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench.report import write_json  # noqa: E402
from diffgemma.kernels import (
    dispatch,  # noqa: E402
    library,  # noqa: E402
)
from diffgemma.kernels import triton_attn as ta  # noqa: E402

DEV, DT, HEADS, KV_HEADS, D, T, WINDOW = "cuda", torch.bfloat16, 16, 8, 256, 4096, 1024


@contextlib.contextmanager
def sdpa_only():
    """`library.attention_window` with the Triton attention module switched off: its SDPA path."""
    was_off = "triton_attn" in dispatch.failed
    dispatch.failed.add("triton_attn")
    try:
        yield
    finally:
        if not was_off:
            dispatch.failed.discard("triton_attn")


def sdpa_window(q, past, chunk, bias) -> torch.Tensor:
    with sdpa_only():
        return library.attention_window(q, past, chunk, bias)


def sweep() -> list[dict]:
    """block_m 64 in 4 warps or 128 in 8 (an fp32 accumulator of 128 registers a thread) x block_n x stages."""
    return [
        {"block_m": bm, "num_warps": nw, "block_n": bn, "num_stages": st}
        for (bm, nw), bn, st in itertools.product(((64, 4), (128, 8)), (32, 64), (1, 2, 3))
    ]


def bench_shape(n: int, configs: list[dict]) -> dict:
    print(f"T={T} past={n} window={WINDOW} d={D} heads={HEADS}/{KV_HEADS}", flush=True)
    q = torch.randn(1, HEADS, T, D, device=DEV, dtype=DT) * D**-0.25
    cache = torch.randn(2, KV_HEADS, WINDOW + 64, D, device=DEV, dtype=DT)
    chunk = torch.randn(2, KV_HEADS, T, D, device=DEV, dtype=DT)
    cache[0] *= D**-0.25
    chunk[0] *= D**-0.25
    past = cache[:, :, 32 : 32 + n]
    bias = library.window_bias(n, T, WINDOW, HEADS // KV_HEADS, DT, DEV)
    want = sdpa_window(q, past, chunk, bias)
    results = {}

    def run(name: str, fn) -> None:
        try:
            diff = float((fn().float() - want.float()).abs().max())
            us = time_graph(fn) * 1e3
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: say so, go on
            print(f"  {name:38s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            return
        results[name] = {"us": us, "max_diff": diff}
        print(f"  {name:38s} {us:8.1f} us  max|diff| {diff:.3g}", flush=True)

    run("sdpa (library.attention_window fallback)", lambda: sdpa_window(q, past, chunk, bias))
    run("triton window (module defaults)", lambda: ta.attention_window_rows(q, past, chunk, WINDOW))
    for c in configs:
        label = "triton window m{block_m} n{block_n} w{num_warps} st{num_stages}".format(**c)
        run(label, lambda c=c: ta.attention_window_rows(q, past, chunk, WINDOW, **c))
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="time a grid of tiles too")
    p.add_argument("--out", default=None, help="write the timings as JSON here")
    args = p.parse_args()
    torch.manual_seed(0)
    configs = sweep() if args.sweep else []
    results = {f"past={n}": bench_shape(n, configs) for n in (0, WINDOW - 1)}
    if args.out:
        doc = {"device": torch.cuda.get_device_name(), "t": T, "window": WINDOW, "shapes": results}
        write_json(args.out, doc, indent=1)


if __name__ == "__main__":
    main()
