"""The graphed denoise step (median of 10, CUDA events) at several (cache size, cached length) pairs, each cache
filled by a bf16 prefill, at the real shape with random weights: whether the step depends on the cache's
geometry (`KVCache.denoise_geometry`, printed). Runs from the source tree on PYTHONPATH.

    PYTHONPATH=src python bench/step_geometry.py
"""

import statistics

import torch

from diffgemma.bench import REAL_CONFIG, random_model, timed

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
c, v = model.cfg.canvas_length, model.cfg.vocab_size
canvas = torch.randint(0, v, (1, c))
probs = torch.softmax(torch.randn(c, v, device="cuda"), -1)
for max_tokens, length in ((1480, 968), (2304, 968), (2304, 1792), (8192, 968), (1480, 200), (8192, 1792)):
    kv = model.new_cache(max_tokens)
    ids = torch.randint(0, v, (1, length))
    model.prefill(ids, kv)
    ms = timed(lambda kv=kv: model.denoise(canvas, kv, sc_probs=probs), torch.device("cuda"), 3, 10)
    print(
        f"cache {max_tokens:5d} length {length:5d} geometry {kv.denoise_geometry(c)}: {statistics.median(ms):.2f} ms",
        flush=True,
    )
    del kv
