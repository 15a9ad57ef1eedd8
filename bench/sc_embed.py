"""The self-conditioning soft embedding at the real shape (probs [N, 262,144] @ embed [262,144, 2,816], bf16):
today's GEMM (cuBLAS on the masked probabilities) against the survivor gather (kernels/triton_sc_embed.py), at
1 and 16 canvases (256 and 4,096 rows), on stated distributions of the rows:

- flat: softmax of N(0, 1) logits, as random weights give: every token survives the e^-10 floor, every row
  overflows and takes the dense rows' GEMM;
- peaked: each row keeps as many tokens as a row of the demo model did (`DEMO_SURVIVORS`, measured on CPU over
  4,000 SC rows of 8 chat prompts with sc_sparse on: median 1, 99th percentile 19, at most 78 of its 2,432),
  drawn at random columns with log-probabilities uniform within the floor;
- fixed k: every row keeps k tokens; "peaked + 1 flat row": the peaked rows with one flat row among them.

Also the dense rows' GEMM over candidate tiles (flat rows), the survivor scan alone, the exact path of
sc_sparse=False (unchanged code, timed for scale), and with `--step` the whole graphed denoise step at 1k
context on random real-shape weights, the gather against the GEMM in one process (two caches, each with its own
graph; the GEMM's captured with the gather module switched off through the dispatch gate), alternating rounds,
flat and peaked SC inputs. Kernel timings: a CUDA graph of 10 calls, the median of 20 replays, per call.

    python bench/sc_embed.py [--step] [--out bench/results/sc_embed.json]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench.report import write_json  # noqa: E402
from diffgemma.kernels import dispatch  # noqa: E402
from diffgemma.kernels import triton_sc_embed as se  # noqa: E402
from diffgemma.model.model import DiffusionGemma  # noqa: E402

V, H, CANVAS = 262144, 2816, 256
# (survivors, rows) of the demo model's SC inputs (4,000 rows)
DEMO_SURVIVORS = (
    (1, 3461), (2, 143), (3, 68), (4, 75), (5, 39), (6, 19), (7, 28), (8, 14), (9, 23), (10, 11), (11, 10),
    (12, 16), (13, 12), (14, 5), (15, 8), (16, 8), (17, 12), (18, 5), (19, 8), (20, 1), (21, 3), (22, 1),
    (23, 1), (24, 1), (25, 2), (26, 1), (27, 3), (29, 2), (30, 2), (34, 2), (35, 1), (36, 2), (37, 1), (39, 2),
    (43, 1), (44, 1), (56, 1), (58, 1), (59, 1), (65, 1), (67, 1), (78, 3),
)  # fmt: skip
NAME = "triton_sc_embed"


def rows_with(counts: list[int], g: torch.Generator) -> torch.Tensor:
    """bf16 probabilities [len(counts), V]: row r keeps counts[r] random columns, log-probabilities uniform in
    [-10, 0] before normalizing (all above the e^-10 floor), zero elsewhere."""
    probs = torch.zeros(len(counts), V, device="cuda")
    for r, k in enumerate(counts):
        cols = torch.randperm(V, device="cuda", generator=g)[:k]
        probs[r, cols] = torch.softmax(torch.rand(k, device="cuda", generator=g) * -10.0, dim=0)
    return probs.bfloat16()


def demo_counts(n: int, g: torch.Generator) -> list[int]:
    """n survivor counts drawn from the demo model's histogram."""
    counts = torch.tensor([c for c, _ in DEMO_SURVIVORS])
    weights = torch.tensor([float(r) for _, r in DEMO_SURVIVORS])
    return counts[torch.multinomial(weights, n, replacement=True, generator=g)].tolist()


def flat_rows(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(n, V, device="cuda", generator=g), dim=-1).bfloat16()


def distributions(n: int, g: torch.Generator, sweep: bool) -> dict[str, torch.Tensor]:
    cpu = torch.Generator().manual_seed(n)
    peaked_counts = demo_counts(n, cpu)
    out = {"flat": flat_rows(n, g), "peaked": rows_with(peaked_counts, g)}
    if sweep:
        mixed = out["peaked"].clone()
        mixed[n // 2] = flat_rows(1, g)[0]
        out["peaked + 1 flat row"] = mixed
        for k in (16, 64, 256):
            out[f"fixed {k}"] = rows_with([k] * n, g)
    return out


def ulps(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return {"max_bf16_steps": int(d.max()), "equal_fraction": float((a == b).float().mean())}


def kernels(res: dict, g: torch.Generator) -> None:
    embed = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    gather = dispatch.triton(NAME, embed)
    if gather is None:
        raise SystemExit("diffgemma: error: the survivor gather's Triton module is unavailable")
    for n in (CANVAS, 16 * CANVAS):
        dists = distributions(n, g, sweep=n == CANVAS)
        for dist, probs in dists.items():
            row = {"survivors_median": int((probs != 0).sum(-1).median())}
            row["overflow_rows"] = int(((probs != 0).sum(-1) > se.CAP).sum())
            row["gemm_us"] = time_graph(lambda p=probs: p @ embed) * 1e3
            row["gather_us"] = time_graph(lambda p=probs: gather.soft_embedding(p, embed)) * 1e3
            row["scan_us"] = time_graph(lambda p=probs: se.survivors(p)) * 1e3
            row["vs_gemm"] = ulps(gather.soft_embedding(probs, embed), probs @ embed)
            res["kernels"][f"{n} rows, {dist}"] = row
            print(
                f"{n:5d} rows {dist:22s} survivors {row['survivors_median']:6d} (overflow {row['overflow_rows']:4d}):"
                f" GEMM {row['gemm_us']:8.1f} us, gather {row['gather_us']:8.1f} us (scan {row['scan_us']:5.1f}),"
                f" vs GEMM {row['vs_gemm']}",
                flush=True,
            )
        if n == CANVAS:
            flat = dists["flat"]
            for tiles, splits in (
                (se.TILES, None),
                (se.TILES, 4),  # every split whole (no K mask), 1.33 waves
                (se.DenseTiles(128, 256, 64, 8, 3), None),
                (se.DenseTiles(64, 256, 64, 4, 4), None),
                (se.DenseTiles(128, 128, 64, 8, 4), None),
                (se.DenseTiles(128, 128, 64, 4, 3), 2),
            ):
                s = splits or se.splits_for(n, H, V, tiles)
                us = (
                    time_graph(lambda t=tiles, s=s, f=flat: se.soft_embedding(f, embed, tiles=t, splits=s))
                    * 1e3
                )
                res["dense_tiles"][f"{tuple(tiles)}, splits {s}"] = us
                print(f"dense rows' tiles {tuple(tiles)} splits {s}: flat {us:8.1f} us", flush=True)
        del dists
    probs = torch.softmax(torch.randn(CANVAS, V, device="cuda", generator=g) * 4, dim=-1)
    host = types.SimpleNamespace(embed=embed)
    res["exact_us"] = time_graph(lambda: DiffusionGemma.soft_embedding(host, probs, True), calls=2) * 1e3
    print(f"exact path (sc_sparse=False, fp32 chunks; unchanged): {res['exact_us']:8.1f} us", flush=True)


def step(res: dict, g: torch.Generator, rounds: int) -> None:
    """The graphed denoise step at 1k context, gather against GEMM, flat and peaked SC inputs."""
    from diffgemma.bench.shapes import REAL_CONFIG
    from diffgemma.bench.timing import timed
    from diffgemma.bench.weights import random_model
    from diffgemma.config import RuntimeConfig
    from diffgemma.runner.runner import ModelRunner

    model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
    runner = ModelRunner(model, RuntimeConfig(device="cuda", dtype="bfloat16", sc_gather=True))
    cpu = torch.Generator().manual_seed(5)
    c = model.cfg.canvas_length
    ids = torch.randint(0, V, (1, 1024), generator=cpu)
    canvas = torch.randint(0, V, (1, c), generator=cpu).cuda()
    sc = {"flat": flat_rows(c, g), "peaked": rows_with(demo_counts(c, cpu), g)}
    caches = {}
    for lever in ("gather", "gemm"):
        caches[lever] = runner.new_cache(1024 + 2 * c)
        runner.prefill(ids, caches[lever])

    def one(lever: str, dist: str) -> None:
        off = lever == "gemm" and NAME not in dispatch.failed
        if off:
            dispatch.failed.add(NAME)  # the gate then serves the GEMM, in this cache's graph too
        try:
            runner.denoise(canvas, caches[lever], sc_probs=sc[dist], raw=True)
        finally:
            if off:
                dispatch.failed.discard(NAME)

    for lever in caches:  # capture
        for dist in sc:
            one(lever, dist)
    times: dict[str, list[float]] = {f"{lv}, {d}": [] for lv in caches for d in sc}
    for _ in range(rounds):
        for lever in caches:
            for dist in sc:
                times[f"{lever}, {dist}"] += timed(lambda lv=lever, d=dist: one(lv, d), model.device, 3, 10)
    for key, ms in times.items():
        res["step_ms"][key] = statistics.median(ms)
        print(f"denoise step at 1k, {key:16s}: {res['step_ms'][key]:.3f} ms", flush=True)
    res["step_setup"] = "random real-shape weights (hf init), 1k prompt, canvas 256, graphed, raw logits"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--step", action="store_true", help="also the whole denoise step, gather against GEMM")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    # ended by a time limit: what was measured is still written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "cap": se.CAP, "tiles": tuple(se.TILES)}
    res.update(kernels={}, dense_tiles={}, step_ms={})
    try:
        kernels(res, g)
        torch.cuda.empty_cache()
        if args.step:
            step(res, g, args.rounds)
    finally:
        if args.out:
            write_json(args.out, res, indent=1)


if __name__ == "__main__":
    main()
