"""Session 22: the router's GEMM as split partial products summed by the top-k kernel
(`triton_route.route_sort_from`; sN: at most N splits, `ROUTER_MAX_SPLITS`; kBsN: of B columns,
`ROUTER_BLOCK_K`) against cuBLAS's split-K GEMM and
`route_sort` on its logits (old).

One process, the real shape (random weights, init hf): denoise graphs captured with each, replayed
alternately in rounds; the first again last (an order-effect control). Also the routing pieces alone at
256 rows (graphs of 20 calls)."""

import statistics
import sys

import torch
import torch.nn.functional as F

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused
from diffgemma.kernels import triton_route as tr

order = sys.argv[1].split(",")
ctxs = [int(a) for a in sys.argv[2:]] or [1024]
ROUNDS, REPS = 7, 20
new_route = fused._route


def old_route(r, proj, pes, top_k, regions):
    weights, _, bounds, perm, slot = tr.route_sort(F.linear(r, proj), pes, top_k)
    return weights, bounds, perm, slot


def graph_us(fn, calls=20):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    ms = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(ms)


def use(name: str) -> None:
    """old; sN (at most N splits of 256 columns); kBsN (of B columns)."""
    fused._route = old_route if name == "old" else new_route
    if name != "old":
        block, splits = name[1:].split("s") if name.startswith("k") else (256, name[1:])
        tr.ROUTER_BLOCK_K, tr.ROUTER_MAX_SPLITS = int(block), int(splits)


def routing_alone(n: int, name: str) -> str:
    x = torch.randn(n, 2816, device="cuda").bfloat16()
    proj = (torch.randn(128, 2816, device="cuda") * 2816**-0.5).bfloat16()
    pes = torch.rand(128, device="cuda") + 0.5
    use(name)
    if name == "old":
        return f"routing alone, {n} rows, old: {graph_us(lambda: old_route(x, proj, pes, 8, {})):.1f} us (its GEMM {graph_us(lambda: F.linear(x, proj)):.1f})"
    new = graph_us(lambda: new_route(x, proj, pes, 8, {}))
    parts = graph_us(lambda: tr.router_partials(x, proj))
    return f"routing alone, {n} rows, {name}: {new:.1f} us (partials {parts:.1f}, splits {tr.router_partials(x, proj).shape[0]})"


for name in dict.fromkeys(order):
    print(routing_alone(256, name), flush=True)

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in ctxs:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(order):
        use(name)
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    use(order[-1])
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
    first = next(iter(outs.values()))
    print(
        f"ctx {ctx}: logits equal to the first {[torch.equal(first, o) for o in outs.values()]}; argmax agreement "
        f"{[round((first.argmax(-1) == o.argmax(-1)).float().mean().item(), 3) for o in outs.values()]}",
        flush=True,
    )
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
        print(
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
