"""`ask` runs the fused path's regions eagerly (session 23: a one-block reply 2.45 s against 8.2-15.0 s compiled in a
new process). Left out then: a long prompt's prefill with eager regions. One process, the real shape (random
weights, init hf): prefill 8k and 32k prompts into an empty cache with the regions compiled (the first call's
time, which compiles, apart), then eager; tok/s, median of 3 each."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG, random_model

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
g = torch.Generator().manual_seed(0)
res: dict = {}


def prefill_s(n: int) -> float:
    kv = model.new_cache(n + 512)
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.prefill(ids, kv)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


for mode in ("compiled", "eager"):
    model.compile_regions(mode == "compiled")
    res[f"{mode}_first_8k_s"] = prefill_s(8192)  # compiles the prefill regions when compiled
    for n in (8192, 32768):
        s = statistics.median(prefill_s(n) for _ in range(3))
        res[f"{mode}_{n}_tok_s"] = n / s
    print(
        f"{mode}: first 8k prefill {res[f'{mode}_first_8k_s']:.2f} s; "
        f"8k {res[f'{mode}_8192_tok_s']:,.0f} tok/s, 32k {res[f'{mode}_32768_tok_s']:,.0f} tok/s",
        flush=True,
    )
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
