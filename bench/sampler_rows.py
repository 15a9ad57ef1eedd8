"""Microbenchmark of a denoise step's sampler row pass at the real shape (256 rows of 262,144 fp32 logits): the
torch ops of `engine.sampler.row_stats` with the sparse SC probabilities after them, against the Triton kernels
of `triton_sampler.row_stats` writing the sparse SC probabilities themselves (and, as under categorical
sampling, the dense probabilities too), and as generation runs them: on the graph's bf16 logits before the
final softcap, which they apply, the SC input into a bf16 buffer. Each timing is a CUDA graph of 10 calls, the
median of 20 replays, per call. Prints a line per candidate; `--out FILE` writes JSON.

    python bench/sampler_rows.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench.report import write_json  # noqa: E402
from diffgemma.engine import sampler as S  # noqa: E402
from diffgemma.kernels import dispatch  # noqa: E402
from diffgemma.kernels import triton_sampler as ts  # noqa: E402

ROWS, VOCAB, TEMP = 256, 262144, 0.7


def torch_pass(logits: torch.Tensor) -> torch.Tensor:
    was_off = "triton_sampler" in dispatch.failed
    dispatch.failed.add("triton_sampler")  # the gate then serves the torch ops
    try:
        return S.row_stats(logits, TEMP, sc_sparse=True).sc
    finally:
        if not was_off:
            dispatch.failed.discard("triton_sampler")


def triton_pass(logits: torch.Tensor, need_probs: bool = False) -> torch.Tensor:
    return ts.row_stats(logits, TEMP, S.SC_SPARSE_LOG_RATIO, need_probs)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    raw = (torch.randn(ROWS, VOCAB, device="cuda") * 6).to(torch.bfloat16)  # before the softcap
    logits = 30 * torch.tanh(raw.float() / 30)
    sc_bf16 = torch.empty(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16)
    gb = ROWS * VOCAB * 4 / 1e9
    res = {}
    cands = (
        ("torch", torch_pass),
        ("triton", triton_pass),
        ("triton, dense probs too", lambda x: triton_pass(x, True)),
        (
            "triton, as generation",  # bf16 rows softcapped in the kernel, SC into bf16 (`gb` counts fp32)
            lambda x: ts.row_stats(raw, TEMP, S.SC_SPARSE_LOG_RATIO, False, sc_bf16, 30.0)[1],
        ),
    )
    for name, fn in cands:
        res[name] = us = time_graph(lambda f=fn: f(logits)) * 1e3
        print(
            f"{name:24s} row stats + sparse SC probs: {us:7.1f} us ({gb / (us * 1e-6):.0f} GB/s of logits)",
            flush=True,
        )
    want, got = torch_pass(logits), triton_pass(logits)
    res["max_abs_diff_sc"] = diff = float((want - got).abs().max())
    print(f"max |diff| of the SC probabilities {diff:.3g}", flush=True)
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), **res}, indent=1)


if __name__ == "__main__":
    main()
