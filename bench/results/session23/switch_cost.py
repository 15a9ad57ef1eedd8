"""What a server pays when consecutive requests run on different conversations' caches: the model keeps the
denoise/commit graphs of one cache only, so each switch captures them again. Two caches with a 1k prompt each;
one block of 48 fixed steps a request, first on one cache repeatedly, then alternating; and the memory allocated
after each cache's first request (what keeping a cache's graphs costs).

    PYTHONPATH=src python .dev/switch_cost.py
"""

from __future__ import annotations

import json
import os
import time

import torch

from diffgemma.bench import REAL_CONFIG, fixed_steps_sampler, random_model
from diffgemma.engine.generate import generate
from diffgemma.kernels import cuda as fast_ops

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
n_cap = [0, 0.0]
real = fast_ops.GraphStep


def counted(*a, **k):
    torch.cuda.synchronize()
    s = time.perf_counter()
    g = real(*a, **k)
    torch.cuda.synchronize()
    n_cap[0] += 1
    n_cap[1] += time.perf_counter() - s
    return g


fast_ops.GraphStep = counted
sampler = fixed_steps_sampler(48)
canvas = model.cfg.canvas_length
caches = [model.new_cache(1024 + 8 * canvas) for _ in range(2)]
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, model.cfg.vocab_size, (1024,), generator=g).tolist() for _ in range(2)]


def request(i: int) -> dict:
    kv = caches[i]
    kv.reset()
    c0 = tuple(n_cap)
    torch.cuda.synchronize()
    s = time.perf_counter()
    generate(model, prompts[i], kv, sampler, max_new_tokens=canvas)
    torch.cuda.synchronize()
    return {
        "cache": i,
        "wall_s": round(time.perf_counter() - s, 4),
        "captures": n_cap[0] - c0[0],
        "capture_s": round(n_cap[1] - c0[1], 4),
    }


GIB = 2**30
mem = {"before": torch.cuda.memory_allocated() / GIB}
for n, i in enumerate((0, 1, 0, 1)):  # warm-up: compiles, first captures
    request(i)
    if n < 2:
        torch.cuda.synchronize()
        mem[f"after first request on cache {i}"] = torch.cuda.memory_allocated() / GIB
print("allocated GiB", {k: round(v, 3) for k, v in mem.items()}, flush=True)
rows = {
    "memory_gib": mem,
    "same": [request(0) for _ in range(6)],
    "alternating": [request(i % 2) for i in range(8)],
}
for k, v in rows.items():
    if k == "memory_gib":
        continue
    for r in v:
        print(k, r, flush=True)
    print(k, "median wall", sorted(r["wall_s"] for r in v)[len(v) // 2], flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "switch_cost.json"), "w") as fh:
    json.dump(rows, fh, indent=1)
