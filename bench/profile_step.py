"""Kernel-level profile of one denoise step and one prefill chunk at the real shape (random weights)."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16)
model.use_graphs = False
cfg = model.cfg
kv = model.new_cache(ctx + 4096 + 512)
ids = torch.randint(0, cfg.vocab_size, (1, ctx))
model.prefill(ids, kv, chunk=4096)
canvas = torch.randint(0, cfg.vocab_size, (1, 256))
probs = torch.softmax(torch.randn(256, cfg.vocab_size, device="cuda"), -1)
chunk = torch.randint(0, cfg.vocab_size, (1, 4096))
for _ in range(2):
    model.denoise(canvas, kv, sc_probs=probs)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model.denoise(canvas, kv, sc_probs=probs)
    torch.cuda.synchronize()
print("=== denoise step (eager, fast ops), ctx", ctx)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=90))
n = kv.length
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model.prefill(chunk, kv, chunk=4096)
    torch.cuda.synchronize()
kv.length = n
print("=== prefill chunk 4096 at", n)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=90))
