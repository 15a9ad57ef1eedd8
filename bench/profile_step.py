"""Kernel profile, on one model build at the real shape (random weights, transformers' init): the denoise step
(the fast kernels, run eagerly so that the profiler sees each kernel) at 1k and 32k context with the graphed step's
CUDA-event median beside it, and a 4096-token prefill chunk after 4096 cached tokens.

Run on a GPU from the repository root: `python bench/profile_step.py` (results/h200_step_profile.txt)."""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.config import RuntimeConfig
from diffgemma.runner.runner import ModelRunner

t0 = time.time()
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
runner = ModelRunner(model, RuntimeConfig(prefill_chunk=4096).validated())
print(f"model built in {time.time() - t0:.1f}s, fast kernels={runner.fast}", flush=True)
cfg = model.cfg
probs = torch.softmax(torch.randn(256, cfg.vocab_size, device="cuda"), -1)
canvas = torch.randint(0, cfg.vocab_size, (1, 256))


def table(prof, n=32):
    ev = prof.key_averages()
    tot = sum(e.self_device_time_total for e in ev) / 1e3
    cnt = sum(e.count for e in ev if e.self_device_time_total > 0)
    print(f"{cnt} kernels, {tot:.2f} ms GPU time")
    print(ev.table(sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=80))


for ctx in (1024, 32768):
    kv = runner.new_cache(ctx + 4096 + 512)
    runner.prefill(torch.randint(0, cfg.vocab_size, (1, ctx)), kv)
    runner.graphs_on = True
    for _ in range(3):
        runner.denoise(canvas, kv, sc_probs=probs)
    torch.cuda.synchronize()
    ms = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.denoise(canvas, kv, sc_probs=probs)
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    print(f"=== ctx {ctx}: graphed denoise median {sorted(ms)[5]:.2f} ms", flush=True)
    runner.graphs_on = False
    for _ in range(2):
        runner.denoise(canvas, kv, sc_probs=probs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.denoise(canvas, kv, sc_probs=probs)
        torch.cuda.synchronize()
    print(f"=== denoise step (fast kernels, eager), ctx {ctx}")
    table(prof)
    if ctx == 1024:
        kv2 = runner.new_cache(8192 + 512, ring_size=8192 + 512)  # linear: truncating 4,096 back is allowed
        runner.prefill(torch.randint(0, cfg.vocab_size, (1, 4096)), kv2)
        chunk = torch.randint(0, cfg.vocab_size, (1, 4096))
        n = kv2.length
        runner.prefill(chunk, kv2)
        kv2.truncate(n)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.prefill(chunk, kv2)
            torch.cuda.synchronize()
        kv2.truncate(n)
        print("=== prefill chunk 4096 at 4096")
        table(prof, 28)
        # A 1k prompt into an empty cache: its rate has been ~20k tok/s against ~54k for 8k. Host-bound if the
        # call's time is well above its kernels' time.
        short = torch.randint(0, cfg.vocab_size, (1, 1024))
        for _ in range(2):
            kv2.reset()
            runner.prefill(short, kv2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kv2.reset()
        runner.prefill(short, kv2)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        kv2.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.prefill(short, kv2)
            torch.cuda.synchronize()
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(
            f"=== prefill 1024 tokens, empty cache: {wall * 1e3:.1f} ms wall, the call returned after "
            f"{host * 1e3:.1f} ms, kernels {gpu:.1f} ms"
        )
        del kv2
    del kv
    torch.cuda.empty_cache()
