"""Where a short prefill's time goes, at the real shape (random weights, transformers' init): for prompts into
an empty cache (1k first, then 256, 2k, 4k), a 200-token prompt with fp32 activations (seed rule 7, the
sampler's prefill_f32_max_tokens) and a block's commit (256 tokens after a 1k prompt, in the model's dtype as
generation commits),
the call's wall time against the time the host took to return and the kernels' time. Then, for the commit,
cProfile (top functions by own and by cumulative time) and torch.profiler's CPU-side table (aten ops and CUDA
runtime calls, host syncs included). Run on a GPU from the repository root: `python bench/prefill_host.py`."""

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model


def timings(call: Callable[[], None], prepare: Callable[[], None]) -> tuple[float, float, float]:
    """(wall, host return, kernel) ms of `call` after `prepare`: medians of 5 after 3 warm-ups."""
    walls = []
    for i in range(8):
        prepare()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        if i >= 3:
            walls.append((time.perf_counter() - t0, host))
    prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    wall, host = sorted(walls)[len(walls) // 2]
    return wall * 1e3, host * 1e3, gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,256,2048,4096", help="prompt lengths into an empty cache")
    args = ap.parse_args()
    model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
    vocab = model.cfg.vocab_size
    sizes = [int(t) for t in args.tokens.split(",")]
    kv = model.new_cache(max(sizes) + 512)
    f32 = torch.float32

    def report(what: str, call: Callable[[], None], prepare: Callable[[], None]) -> None:
        wall, host, gpu = timings(call, prepare)
        print(
            f"{what}: wall {wall:.1f} ms, host returned after {host:.1f} ms, kernels {gpu:.1f} ms", flush=True
        )

    for n in sizes:
        ids = torch.randint(0, vocab, (1, n))
        report(f"prefill {n} tokens", lambda ids=ids: model.prefill(ids, kv), kv.reset)
    short = torch.randint(0, vocab, (1, 200))
    report(
        "prefill 200 tokens, fp32 activations", lambda: model.prefill(short, kv, compute_dtype=f32), kv.reset
    )
    kv.reset()
    model.prefill(torch.randint(0, vocab, (1, 1024)), kv)
    block = torch.randint(0, vocab, (1, 256))

    def commit() -> None:
        model.prefill(block, kv)

    def rewind() -> None:
        kv.length = 1024

    report("commit 256 tokens after 1024", commit, rewind)

    rewind()
    pr = cProfile.Profile()
    pr.enable()
    commit()
    torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(f"=== commit, cProfile by {key}\n" + s.getvalue().split("\n", 6)[-1])
    rewind()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        commit()
        torch.cuda.synchronize()
    print("=== commit, torch.profiler, CPU side")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
