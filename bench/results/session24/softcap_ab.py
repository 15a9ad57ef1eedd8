"""The final softcap in the sampler's row pass (new) against a softcap pass writing fp32 logits that the row pass
then reads (old), in one process at the real shape (random weights, transformers' init).

1. The two kernels alone on a real step's raw logits: the softcap region + row pass on fp32, against the row
   pass on the bf16 raw logits; CUDA events over graphs of 20 calls, 7 rounds alternating.
2. Their outputs on that step: argmax, entropy, p_max, and the SC input (bf16), old against new.
3. Generation: a 1k prompt, one block of 256 at 48 fixed steps, old against new alternating (the old path
   emulated by a wrapper that softcaps into fp32 before the row pass), 5 rounds; the ids of each.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG, fixed_steps_sampler, random_model
from diffgemma.engine import generate as G
from diffgemma.engine import sampler as S
from diffgemma.kernels import triton_sampler as ts

out_path = sys.argv[1] if len(sys.argv) > 1 else None
torch.manual_seed(0)
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
model.fast, model.fuse = True, True
cap = model.cfg.final_logit_softcapping
res: dict = {}

# a real step's raw logits after a 1k prompt
kv = model.new_cache(1024 + 2 * 256 + 256)
g = torch.Generator().manual_seed(1)
model.prefill(torch.randint(0, model.cfg.vocab_size, (1, 1024), generator=g), kv)
canvas = torch.randint(0, model.cfg.vocab_size, (1, 256), generator=g)
raw = model.denoise(canvas, kv, raw=True)[0].clone()
print("raw logits", raw.dtype, float(raw.float().abs().max()), flush=True)
sc_buf = torch.empty(256, model.cfg.vocab_size, device="cuda", dtype=torch.bfloat16)
temp = 0.8


def old():
    x = model._softcap(raw)
    return ts.row_stats(x, temp, S.SC_SPARSE_LOG_RATIO, False, sc_buf)


def new():
    return ts.row_stats(raw, temp, S.SC_SPARSE_LOG_RATIO, False, sc_buf, cap)


def softcap_only():
    return model._softcap(raw)


def graph_of(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(n):
            fn()
    return gr


def time_graph(gr, n=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gr.replay()
    s.record()
    gr.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


graphs = {"old": graph_of(old), "new": graph_of(new), "softcap_only": graph_of(softcap_only)}
times: dict = {k: [] for k in graphs}
for _ in range(7):
    for k, gr in graphs.items():
        times[k].append(time_graph(gr))
res["kernels_us"] = {k: statistics.median(v) for k, v in times.items()}
res["kernels_us_all"] = times
print("kernels (us a call):", {k: round(v, 1) for k, v in res["kernels_us"].items()}, flush=True)

# outputs, old against new
_, _, e_old, a_old, p_old = old()
sc_old = sc_buf.clone()
_, _, e_new, a_new, p_new = new()
sc_new = sc_buf.clone()
res["outputs"] = {
    "argmax_equal": float((a_old == a_new).float().mean()),
    "entropy_max_abs": float((e_old - e_new).abs().max()),
    "entropy_equal": float((e_old == e_new).float().mean()),
    "p_max_equal": float((p_old == p_new).float().mean()),
    "sc_equal": float((sc_old == sc_new).float().mean()),
    "softcap_max_abs_vs_torch": float(
        (model._softcap(raw) - torch.tanh(raw.float() / cap) * cap).abs().max()
    ),
}
print("outputs:", res["outputs"], flush=True)

# generation, old against new
real_row_stats = S.row_stats


def row_stats_old(logits, temp, sc_sparse=False, need_probs=True, sc_out=None, softcap=None):
    if softcap is not None:
        logits = model._softcap(logits)
    return real_row_stats(logits, temp, sc_sparse, need_probs, sc_out)


cfg = fixed_steps_sampler(48)
prompt = torch.randint(0, model.cfg.vocab_size, (1024,), generator=g).tolist()
gkv = model.new_cache(1024 + 256)
gen: dict = {"old": [], "new": []}
ids: dict = {"old": set(), "new": set()}
for r in range(6):
    for mode in ("old", "new"):
        S.row_stats = row_stats_old if mode == "old" else real_row_stats
        gkv.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = G.generate(model, prompt, gkv, cfg, max_new_tokens=256)
        torch.cuda.synchronize()
        if r > 0:  # round 0 compiles and captures
            gen[mode].append(time.perf_counter() - t0)
        ids[mode].add(hashlib.sha1(str(o.token_ids).encode()).hexdigest()[:12])
S.row_stats = real_row_stats
res["generate_s"] = {k: statistics.median(v) for k, v in gen.items()}
res["generate_s_all"] = gen
res["ids"] = {k: sorted(v) for k, v in ids.items()}
print("generate (s):", res["generate_s"], "ids:", res["ids"], flush=True)
if out_path:
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
