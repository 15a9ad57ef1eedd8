"""The fp32-activation prefill of a 200-token prompt (seed rule 7: prompts of up to 256 tokens) at the real
shape, random weights: wall time (median of the last four of six), kernel time and the top kernels. Runs from
the source tree on PYTHONPATH.

    PYTHONPATH=src python bench/fp32_prefill.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
kv = model.new_cache(1024)
ids = torch.randint(0, model.cfg.vocab_size, (1, 200))
walls = []
for _ in range(6):
    kv.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.prefill(ids, kv, compute_dtype=torch.float32)
    torch.cuda.synchronize()
    walls.append((time.perf_counter() - t0) * 1e3)
kv.reset()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model.prefill(ids, kv, compute_dtype=torch.float32)
    torch.cuda.synchronize()
ev = prof.key_averages()
gpu = sum(e.self_device_time_total for e in ev) / 1e3
print(
    f"fp32 prefill 200 tokens: wall {sorted(walls[2:])[2]:.1f} ms (runs {[round(w) for w in walls]}), kernels {gpu:.1f} ms"
)
print(ev.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=70))
