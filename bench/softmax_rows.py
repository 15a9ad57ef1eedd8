"""Microbenchmark of `triton_softmax.softmax_rows` (fp32 scores -> bf16 probabilities) at a full layer's denoise
shape, [2 KV heads, 2,048 folded query rows, S keys], for several numbers of programs sharing the rows: one a
row (every row its own program, as many in flight as the SMs hold) or k an SM. Prints us and the HBM rate if
each fp32 row were read once (pass 2 from L2) and twice; `--out FILE` writes JSON.

    python bench/softmax_rows.py [--keys 1280,4352,33024,131328] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.kernels import triton_softmax as ts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="1280,4352,33024,131328")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    for keys in (int(k) for k in args.keys.split(",")):
        x = torch.randn(2, 2048, keys, device="cuda") * 6
        want = torch.softmax(x, dim=-1).bfloat16()
        once, twice = x.numel() * 6 / 1e6, x.numel() * 10 / 1e6  # MB: fp32 read + bf16 write
        row = {}
        for label, programs in [("a program a row", x.shape[0] * x.shape[1])] + [
            (f"{k} an SM", k * sms) for k in (1, 2, 4, 8)
        ]:
            got = ts.softmax_rows(x, torch.bfloat16, programs=programs)
            diff = float((got.float() - want.float()).abs().max())
            us = time_graph(lambda p=programs, x=x: ts.softmax_rows(x, torch.bfloat16, programs=p)) * 1e3
            row[label] = {"programs": programs, "us": us, "max_diff_vs_torch": diff}
            print(
                f"keys {keys:6d} {label:16s} {us:8.1f} us  {once / us:5.2f} TB/s one read, "
                f"{twice / us:5.2f} two  max|diff| {diff:.3g}",
                flush=True,
            )
        results[keys] = row
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "keys": results}, indent=1)
        )


if __name__ == "__main__":
    main()
