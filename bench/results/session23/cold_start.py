"""Cold start of one process: what the first generations cost beyond a warm one, and how much of it the
on-disk caches (inductor's FX graph cache, Triton's kernel cache) save a second process.

Per generation: wall, prefill/denoise seconds, the regions' compile seconds (denoise and prefill sets), captures,
and inductor's cache counters. A: 200-token prompt under the default fp32 rule; B: 1,024 tokens (bf16 prefill);
C: A again (warm). Each on a cache of its own, one block of 48 steps. Writes $OUT/cold_TAG.json.

WARM=1 first runs `Engine.warm_up` (timed, with each of its generations); PROFILE=1 prints a cProfile of A and
B, PROFILE_WARM=1 one of the warm-up. Session 23 ran it in calls 2-5; call 2 had no PROFILE, call 4 no timing of
the warm-up's generations (this is call 5's version).

    PYTHONPATH=src python .dev/cold_start.py TAG
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG, fixed_steps_sampler, random_model
from diffgemma.engine.generate import generate
from diffgemma.kernels import cuda as fast_ops

tag = sys.argv[1]
t0 = time.perf_counter()
import torch._dynamo.utils as dyn_utils  # noqa: E402

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
torch.cuda.synchronize()
print(f"[{tag}] build {time.perf_counter() - t0:.1f} s", flush=True)

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


def compile_s() -> float:
    return sum(r.compile_s for r in model.fused_regions.values()) + sum(
        r.compile_s for r in model.prefill_regions.values()
    )


def counters() -> dict:
    c = dyn_utils.counters["inductor"]
    return {k: c[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss") if k in c}


rows = {}
if os.environ.get("WARM"):
    import diffgemma.engine.engine as engine_module
    from diffgemma.engine.engine import Engine

    real_generate = engine_module.generate

    def timed_generate(model_, ids, kv, sampler, **kw):
        c1, cap1 = compile_s(), tuple(n_cap)
        s1 = time.perf_counter()
        o = real_generate(model_, ids, kv, sampler, **kw)
        torch.cuda.synchronize()
        print(
            f"[{tag}]   warm-up generation of {len(ids)} tokens: {time.perf_counter() - s1:.3f} s, prefill"
            f" {o.prefill_seconds:.3f}, denoise {o.denoise_seconds:.3f}, blocks {o.blocks}, steps {o.steps},"
            f" regions {compile_s() - c1:.3f} s, captures {n_cap[0] - cap1[0]} in {n_cap[1] - cap1[1]:.3f} s",
            flush=True,
        )
        return o

    engine_module.generate = timed_generate
    eng = Engine(model, fixed_steps_sampler(48).replace(prefill_f32_max_tokens=256))
    c0, cap0 = compile_s(), tuple(n_cap)
    if os.environ.get("PROFILE_WARM"):
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        secs = eng.warm_up()
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(30)
    else:
        secs = eng.warm_up()
    rows["warm_up"] = {
        "wall_s": round(secs, 3),
        "region_compile_s": round(compile_s() - c0, 3),
        "captures": n_cap[0] - cap0[0],
        "capture_s": round(n_cap[1] - cap0[1], 3),
        "graphs_left": len(model._graphs),
        "mem_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
    }
    print(f"[{tag}] warm_up: {rows['warm_up']}", flush=True)
for name, n, f32 in (("A", 200, 256), ("B", 1024, 0), ("C", 200, 256)):
    prompt = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = model.new_cache(n + 2 * model.cfg.canvas_length)
    sampler = fixed_steps_sampler(48).replace(prefill_f32_max_tokens=f32)
    c0, cap0, k0 = compile_s(), tuple(n_cap), counters()
    torch.cuda.synchronize()
    s = time.perf_counter()
    prof = None
    if os.environ.get("PROFILE") and name in ("A", "B"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    out = generate(model, prompt, kv, sampler, max_new_tokens=model.cfg.canvas_length)
    if prof is not None:
        import pstats

        prof.disable()
        prof.dump_stats(f"{os.environ.get('OUT', '/tmp')}/prof_{tag}_{name}.pstats")
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(45)
        st.sort_stats("tottime").print_stats(25)
    torch.cuda.synchronize()
    row = {
        "wall_s": round(time.perf_counter() - s, 3),
        "prefill_s": round(out.prefill_seconds, 3),
        "denoise_s": round(out.denoise_seconds, 3),
        "region_compile_s": round(compile_s() - c0, 3),
        "captures": n_cap[0] - cap0[0],
        "capture_s": round(n_cap[1] - cap0[1], 3),
        "inductor": {k: v - k0.get(k, 0) for k, v in counters().items()},
    }
    rows[name] = row
    print(f"[{tag}] {name}: {row}", flush=True)
    del kv
out_dir = os.environ.get("OUT", "/tmp")
with open(f"{out_dir}/cold_{tag}.json", "w") as fh:
    json.dump(rows, fh, indent=1)
