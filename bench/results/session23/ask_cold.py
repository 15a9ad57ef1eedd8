"""A one-shot reply's cost in a fresh process (torch's and Triton's on-disk caches warm) with the fused path's
regions compiled by torch.compile (as now) or run eagerly inside the same CUDA graphs: the first reply (a
200-token prompt under the fp32 rule, one block of 48 steps), a repeat, and the graphed step's median.

    PYTHONPATH=src python .dev/ask_cold.py compiled|eager
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG, fixed_steps_sampler, random_model
from diffgemma.engine.generate import generate
from diffgemma.kernels import fused

mode = sys.argv[1]
t_start = time.perf_counter()
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
if mode == "eager":
    model.fused_regions = fused.make_regions(enabled=False)
    model.prefill_regions = fused.make_regions(enabled=False, dynamic=True)
torch.cuda.synchronize()
row = {"mode": mode, "build_s": round(time.perf_counter() - t_start, 3)}
sampler = fixed_steps_sampler(48).replace(prefill_f32_max_tokens=256)
canvas = model.cfg.canvas_length
prompt = torch.randint(0, model.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
for name in ("first", "repeat"):
    kv = model.new_cache(1024)
    torch.cuda.synchronize()
    s = time.perf_counter()
    out = generate(model, prompt, kv, sampler, max_new_tokens=canvas)
    torch.cuda.synchronize()
    row[name] = {"wall_s": round(time.perf_counter() - s, 3), "prefill_s": round(out.prefill_seconds, 3)}
canvas_ids = torch.randint(0, model.cfg.vocab_size, (1, canvas))
probs = torch.zeros(canvas, model.cfg.vocab_size, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    model.denoise(canvas_ids, kv, sc_probs=probs, copy=False)
ms = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    model.denoise(canvas_ids, kv, sc_probs=probs, copy=False)
    b.record()
    b.synchronize()
    ms.append(a.elapsed_time(b))
row["step_ms"] = round(statistics.median(ms), 3)
row["process_s"] = round(time.perf_counter() - t_start, 3)
print(row, flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"ask_cold_{mode}.json"), "w") as fh:
    json.dump(row, fh, indent=1)
