"""Prefill on the real model (random weights, init hf) in one process: the experts on the grouped GEMMs above 32
pairs an expert ("grouped", as before) against the Triton kernels on the "prefill" tiles up to `max pairs` an
expert, and chunks of 4,096 / 8,192 / 16,384 tokens. 1k and 2k prompts go through the padded prefill's graphs
(dropped at each switch: 2 untimed calls, then 3 timed replays); 8k and 32k run eagerly, each variant warmed
up once, then rounds of one timed prefill each. Peak memory per variant at the longest context."""

import statistics
import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast

VARIANTS = {  # name: (max pairs an expert for Triton, chunk)
    "grouped_c4096": (32, 4096),
    "triton_c4096": (256, 4096),
    "grouped_c8192": (32, 8192),
    "triton_c8192": (512, 8192),
    "triton_c16384": (1024, 16384),
}
ctxs = [int(a) for a in sys.argv[1:]] or [1024, 2048, 8192, 32768]
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v = model.cfg.vocab_size


def run(ids, kv, chunk):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.prefill(ids, kv, chunk=chunk)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


for ctx in ctxs:
    ids = torch.randint(0, v, (1, ctx))
    kv = model.new_cache(ctx + 512)
    graphed = ctx <= 2048
    names = ["grouped_c4096", "triton_c4096"] if graphed else list(VARIANTS)
    if ctx > 32768:
        names = ["triton_c4096", "triton_c8192", "triton_c16384"]
    times = {n: [] for n in names}
    peak = {}
    for rnd in range(4 if graphed else 5 if ctx <= 32768 else 3):
        for name in names:
            fast._TRITON_MAX_PAIRS_PER_EXPERT, chunk = VARIANTS[name]
            if graphed:
                model._prefill_graphs, model._prefill_pool = {}, None
                for _ in range(2):
                    kv.reset()
                    run(ids, kv, chunk)
                for _ in range(3):
                    kv.reset()
                    times[name].append(run(ids, kv, chunk))
            else:
                kv.reset()
                torch.cuda.reset_peak_memory_stats()
                dt = run(ids, kv, chunk)
                peak[name] = torch.cuda.max_memory_allocated() / 2**30
                if rnd > 0:  # round 0 warms up (compiles)
                    times[name].append(dt)
    assert not fast.triton_failed_kernels, fast.triton_failed_kernels
    for name, ts in times.items():
        med = statistics.median(ts)
        extra = f", peak {peak[name]:.1f} GiB" if name in peak else ""
        print(
            f"ctx {ctx:6d} {name:14s} {ctx / med:8.0f} tok/s (median of {len(ts)}: "
            f"{' '.join(f'{t * 1e3:.1f}' for t in ts)} ms){extra}",
            flush=True,
        )
    del kv
    torch.cuda.empty_cache()
