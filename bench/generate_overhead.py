"""Where a generation's time goes beyond its graphed denoise steps, on one model build at the real shape (random
weights, transformers' init): a 1k prompt, then 4 blocks of 256 tokens at 48 fixed steps each
(`engine.generate.generate` with the bench's fixed-step sampler). Per run: wall time, the prefill and denoise
seconds `generate` reports, the CUDA-graph captures (count and seconds, timed around `GraphStep`), the graphed
step's CUDA-event median at the final length, and the denoise time left over per block after steps x median.
The generated ids' hash tells two versions' outputs apart. Runs from the source tree on PYTHONPATH.
`--prompt 200 --f32-max 256` is a short chat turn under the default sampler's fp32 rule for short prompts.

    PYTHONPATH=src python bench/generate_overhead.py [--out FILE] [--prompt N] [--f32-max N]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from diffgemma.bench import REAL_CONFIG, fixed_steps_sampler, random_model, timed, write_json
from diffgemma.engine.generate import generate
from diffgemma.runner import graphs
from diffgemma.runner.runner import ModelRunner

PROMPT, BLOCKS, STEPS, RUNS = 1024, 4, 48, 4


class Captures:
    """Counts and times GraphStep constructions (its warm-up and capture) by wrapping the class."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        real = graphs.GraphStep

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step = real(*args, **kwargs)
            torch.cuda.synchronize()
            self.count += 1
            self.seconds += time.perf_counter() - t0
            return step

        graphs.GraphStep = timed


def step_median_ms(runner: ModelRunner, kv) -> float:
    """The graphed denoise step (SC probabilities given) at the cache's current length, median of 10."""
    canvas = torch.randint(0, runner.cfg.vocab_size, (1, runner.cfg.canvas_length))
    probs = torch.softmax(torch.randn(runner.cfg.canvas_length, runner.cfg.vocab_size, device="cuda"), -1)
    ms = timed(lambda: runner.denoise(canvas, kv, sc_probs=probs), torch.device("cuda"), 3, 10)
    return statistics.median(ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    ap.add_argument(
        "--f32-max",
        type=int,
        default=0,
        help="the sampler's prefill_f32_max_tokens (its default is 256; the bench's fixed-step sampler 0)",
    )
    args = ap.parse_args()
    runner = ModelRunner(random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf"))
    canvas = runner.cfg.canvas_length
    kv = runner.new_cache(args.prompt + (BLOCKS + 1) * canvas)
    prompt = torch.randint(
        0, runner.cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    sampler = fixed_steps_sampler(STEPS).replace(prefill_f32_max_tokens=args.f32_max)
    captures = Captures()
    runs = []
    for r in range(RUNS):  # run 0 warms up (compiles)
        kv.reset()
        c0, s0 = captures.count, captures.seconds
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(runner, prompt, kv, sampler, max_new_tokens=BLOCKS * canvas)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        run = {
            "wall_s": wall,
            "prefill_s": out.prefill_seconds,
            "denoise_s": out.denoise_seconds,
            "steps": out.steps,
            "blocks": out.blocks,
            "captures": captures.count - c0,
            "capture_s": captures.seconds - s0,
            "ids_sha1": hashlib.sha1(str(out.token_ids).encode()).hexdigest()[:12],
        }
        runs.append(run)
        print(
            f"run {r}: wall {wall:.3f} s, prefill {out.prefill_seconds:.3f} s, denoise {out.denoise_seconds:.3f} s"
            f" ({out.steps} steps, {out.blocks} blocks), captures {run['captures']} in {run['capture_s']:.3f} s,"
            f" ids {run['ids_sha1']}",
            flush=True,
        )
    ms = step_median_ms(runner, kv)
    last = runs[1:]
    denoise = sorted(r["denoise_s"] for r in last)[len(last) // 2]
    left = (denoise - STEPS * BLOCKS * ms / 1e3) / BLOCKS
    wall = sorted(r["wall_s"] for r in last)[len(last) // 2]
    print(
        f"graphed step {ms:.2f} ms at length {kv.length}; median of runs 1-{RUNS - 1}: wall {wall:.3f} s, "
        f"denoise {denoise:.3f} s, left over {left * 1e3:.1f} ms a block beyond {STEPS} x the step",
        flush=True,
    )
    if args.out:
        doc = {
            "device": torch.cuda.get_device_name(),
            "setup": f"prompt {args.prompt}, {BLOCKS} blocks of {canvas}, {STEPS} fixed steps, "
            f"prefill_f32_max_tokens {args.f32_max}",
            "runs": runs,
            "step_ms": ms,
            "median_wall_s": wall,
            "median_denoise_s": denoise,
            "left_over_ms_per_block": left * 1e3,
        }
        write_json(args.out, doc, indent=1)


if __name__ == "__main__":
    main()
