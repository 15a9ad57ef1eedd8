"""Where a graphed denoise step's time goes, in one process on the real shape (random weights, init hf):
the whole step; the step with the expert kernels stubbed out (the chain every layer runs before and after
its experts); the same without the dense MLP as well; and the 30 layers' expert kernels alone, replayed on the
inputs they saw in a real step. Each is a CUDA graph; replays alternate over rounds."""

import statistics
import sys

import torch
import triton
import triton.language as tl

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import triton_moe as tm

ROUNDS, REPS = 5, 20
ctxs = [int(c) for c in sys.argv[1:]] or [1024, 32768]
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
cfg = model.cfg
v, c = cfg.vocab_size, 256
real_gate_up, real_down, real_dense = tm.gate_up_act, tm.down_sorted, model.fused_regions["dense_mlp"]
y_zero = torch.zeros(c * cfg.top_k_experts, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
dense_zero = torch.zeros(c, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
expert_bytes = sum((layer.experts_gate_up.numel() + layer.experts_down.numel()) * 2 for layer in model.layers)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    """Reads x (bf16) and writes one fp32 sum per program: the read ceiling of the same bytes."""
    base = tl.program_id(0).to(tl.int64) * PER_PROG
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, PER_PROG, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_all(tensors, per_prog=1 << 18, block=4096):
    for t in tensors:
        n = t.numel()
        grid = triton.cdiv(n, per_prog)
        out = torch.empty(grid, device=t.device)
        _read_kernel[(grid,)](t, out, n, PER_PROG=per_prog, BLOCK=block, num_warps=8)


def timed(graphs: dict) -> dict:
    res = {k: [] for k in graphs}
    for _ in range(ROUNDS):
        for k, g in graphs.items():
            for _ in range(3):
                g()
            torch.cuda.synchronize()
            ms = []
            for _ in range(REPS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g()
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            res[k].append(statistics.median(ms))
    return res


def run(ctx: int) -> None:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)

    def step(ids, p):
        return model._denoise_forward(ids, kv, p, False)

    # the experts' inputs in a real step, one (x2, perm, bounds) per layer
    seen = []

    def recording(x, gate_up, perm, bounds, top_k, tiles):
        seen.append((x.clone(), perm.clone(), bounds.clone(), top_k, tiles))
        return real_gate_up(x, gate_up, perm, bounds, top_k, tiles)

    tm.gate_up_act = recording
    step(canvas, probs)
    torch.cuda.synchronize()
    tm.gate_up_act = real_gate_up
    assert len(seen) == cfg.num_layers, len(seen)
    counts = seen[0][2].diff()
    print(f"ctx {ctx}: layer 0 pairs per expert min {int(counts.min())} max {int(counts.max())}")

    steps = {}
    steps["full step"] = fast_ops.GraphStep(step, canvas, probs, torch.cuda.graph_pool_handle())
    tm.gate_up_act = lambda *a: None
    tm.down_sorted = lambda *a: y_zero
    steps["chain (experts stubbed)"] = fast_ops.GraphStep(step, canvas, probs, torch.cuda.graph_pool_handle())
    model.fused_regions["dense_mlp"] = lambda *a: dense_zero
    steps["chain, no dense MLP"] = fast_ops.GraphStep(step, canvas, probs, torch.cuda.graph_pool_handle())
    tm.gate_up_act, tm.down_sorted, model.fused_regions["dense_mlp"] = real_gate_up, real_down, real_dense

    def experts_only(ids, p):
        out = None
        for layer, (x, perm, bounds, top_k, _) in zip(model.layers, seen, strict=True):
            cfg_t = tm.config_for(x, layer.experts_gate_up)
            act = tm.gate_up_act(x, layer.experts_gate_up, perm, bounds, top_k, cfg_t.gate_up)
            out = tm.down_sorted(act, layer.experts_down, bounds, cfg_t.down)
        return out

    weights = [w for layer in model.layers for w in (layer.experts_gate_up, layer.experts_down)]
    steps["read of the expert weights"] = fast_ops.GraphStep(
        lambda ids, p: read_all(weights), canvas, None, torch.cuda.graph_pool_handle()
    )
    steps["experts alone"] = fast_ops.GraphStep(experts_only, canvas, None, torch.cuda.graph_pool_handle())
    graphs = {k: (lambda s=s: s.graph.replay()) for k, s in steps.items()}
    res = timed(graphs)
    med = {k: statistics.median(r) for k, r in res.items()}
    for k, r in res.items():
        print(f"ctx {ctx}: {k:26s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {med[k]:.3f}")
    for k in ("experts alone", "read of the expert weights"):
        print(f"ctx {ctx}: {k}: {expert_bytes / 1e9:.2f} GB at {expert_bytes / med[k] / 1e9:.2f} TB/s")
    both = med["chain (experts stubbed)"] + med["experts alone"]
    print(f"ctx {ctx}: chain + experts {both:.3f} ms against the step {med['full step']:.3f}", flush=True)


for ctx in ctxs:
    run(ctx)
    torch.cuda.empty_cache()
