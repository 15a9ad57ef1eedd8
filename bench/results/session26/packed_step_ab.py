"""Session 26: the denoise step with 12-bit experts (packed_probe3's kernels: gate_up m32 x 3 stages x 6 slots,
down in 128-column tiles m32 x 3 stages x 2 slots) against the kept bf16 kernels, one process, graphs replayed
alternately in rounds (kept, packed, kept). Exceptions are not corrected here (the logits differ from the kept
ones by what ~1.5e-4 of the expert weights, each below its row's 15 exponents, change)."""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, "bench")
sys.path.insert(0, str(Path(__file__).parent))
import packed_probe3 as pp  # noqa: E402

from diffgemma.bench import REAL_CONFIG, random_model  # noqa: E402
from diffgemma.kernels import cuda as fast_ops  # noqa: E402
from diffgemma.kernels import triton_moe as tm  # noqa: E402

ctxs = [int(a) for a in sys.argv[1:]] or [1024]
ROUNDS, REPS = int(__import__("os").environ.get("ROUNDS", "7")), 20
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
packed = {}
for layer in model.layers:
    gt, gb, _ = pp.pack(layer.experts_gate_up.data)
    dt, db, _ = pp.pack(layer.experts_down.data)
    packed[layer.experts_gate_up.data_ptr()] = (gt, gb)
    packed[layer.experts_down.data_ptr()] = (dt, db)
torch.cuda.empty_cache()
print(f"packed; memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
orig_gu, orig_dn = tm.gate_up_act, tm.down_sorted
use_packed = [False]


def gate_up_act(x, gate_up, perm, bounds, top_k, tiles):
    p = packed.get(gate_up.data_ptr())
    if use_packed[0] and p is not None and tiles == tm.CONFIGS[tm.DEFAULT_CONFIG].gate_up:
        return pp.gate_up_packed(x, p, perm, bounds, 32, 6, 3)
    return orig_gu(x, gate_up, perm, bounds, top_k, tiles)


def down_sorted(act, down, bounds, tiles):
    p = packed.get(down.data_ptr())
    if use_packed[0] and p is not None and tiles == tm.CONFIGS[tm.DEFAULT_CONFIG].down:
        return pp.down_packed(act, p, bounds, 32, 2, 3)
    return orig_dn(act, down, bounds, tiles)


tm.gate_up_act, tm.down_sorted = gate_up_act, down_sorted
v, c = model.cfg.vocab_size, 256
for ctx in ctxs:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(["kept", "packed", "kept"]):
        use_packed[0] = name == "packed"
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False, raw=True),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    use_packed[0] = False
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
    a, b, a2 = outs.values()
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"ctx {ctx}: kept twice equal {torch.equal(a, a2)}; packed max |d| {float((a - b).abs().max()):.3g}, "
          f"mean |d| {float((a - b).abs().mean()):.3g}, argmax agreement {agree:.3f}", flush=True)  # fmt: skip
    res = {k: [] for k in steps}
    for _ in range(ROUNDS):
        for k, s in steps.items():
            for _ in range(3):
                s.graph.replay()
            torch.cuda.synchronize()
            ms = []
            for _ in range(REPS):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                s.graph.replay()
                e1.record()
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
            res[k].append(statistics.median(ms))
    for k, r in res.items():
        print(f"ctx {ctx}: {k:9s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
              flush=True)  # fmt: skip
    del steps, outs
    torch.cuda.empty_cache()
