"""Microbenchmark of the MoE experts of one denoise step: the grouped-GEMM path against the Triton kernels of
`diffgemma.kernels.triton_moe` (every named config), at the real shape (N=256, k=8, E=128, H=2816, I=704,
bf16). Each timing is a CUDA graph of 10 calls, the median of 20 replays (CUDA events), per call; TB/s counts
the expert weights once (gate_up + down, 1.52 GB). Also reports each config's max abs difference from the
grouped path, a read-only bandwidth floor (an amax over the same weights), grouped vs Triton as N grows
(the dispatch crossover), and with --sweep each kernel alone over a grid of tile shapes. With --quant, the
quantized experts (int4, fp8: every candidate config) against the bf16 default (`bench_quant`). Results go to
$OUT/moe_kernels.json when OUT is set.

    python bench/moe_kernels.py [--sweep] [--ids routing.pt] [--configs base,m32] [--quant int4,fp8 [--quant-only]]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from diffgemma.bench.report import write_json  # noqa: E402
from diffgemma.kernels import library  # noqa: E402
from diffgemma.kernels import torch_ref as ref  # noqa: E402
from diffgemma.kernels import triton_moe as tm  # noqa: E402
from diffgemma.quant.weight import QuantWeight  # noqa: E402

N, K, E, H, INTER = 256, 8, 128, 2816, 704
DEV = "cuda"


def time_graph(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    """ms per call: `calls` calls captured in one CUDA graph, median over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: JIT compiles, cuBLAS/CUTLASS workspaces
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def routing(
    kind: str, ids_path: str | None, g: torch.Generator, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router-like weights and ids: uniform logits, logits with a per-expert popularity bias, or ids from
    a file (a real step's routing, [N, k]) with random weights."""
    n = n or N
    logits = torch.randn(n, E, generator=g, device=DEV)
    if kind == "skewed":
        logits = logits + 1.5 * torch.randn(E, generator=g, device=DEV)
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    if kind == "file":
        ids = torch.load(ids_path, map_location=DEV).reshape(n, K).long()
    return w / w.sum(-1, keepdim=True), ids


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def measure(row: dict, label: str, call: Callable[[], torch.Tensor], want: torch.Tensor, nbytes: int) -> dict:
    """One Triton config's row: its output against `want` (max |diff|, relative), its time and TB/s; a config that
    fails to compile or run is reported in the row and the run goes on."""
    try:
        got = call()
        diff = (got.float() - want.float()).abs().max().item()
        rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
        ms = time_graph(call)
        row.update(ms=ms, tbps=tbps(nbytes, ms), max_abs_diff=diff, rel_diff=rel)
        print(f"  {label} {ms:7.3f} ms  {tbps(nbytes, ms):5.2f} TB/s  max|diff| {diff:.3g}  rel {rel:.2g}")
    except Exception as e:  # noqa: BLE001 - a config that fails to compile or run: report, go on
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"  {label} FAILED {row['error']}")
        traceback.print_exc(limit=2)
    return row


def bench_configs(names: list[str], scenarios: list[str], args, gate_up, down, x, g) -> list[dict]:
    nbytes = (gate_up.numel() + down.numel()) * gate_up.element_size()
    rows = []
    for scen in scenarios:
        w, ids = routing(scen, args.ids, g)
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        print(
            f"\n[{scen}] pairs per expert: max {int(counts.max())}, empty experts {int((counts == 0).sum())}"
        )
        want = library.moe_experts_grouped(x, w, ids, gate_up, down)
        ms = time_graph(lambda w=w, ids=ids: library.moe_experts_grouped(x, w, ids, gate_up, down))
        rows.append(dict(scenario=scen, path="grouped", config=None, ms=ms, tbps=tbps(nbytes, ms)))
        print(f"  {'grouped':12s} {ms:7.3f} ms  {tbps(nbytes, ms):5.2f} TB/s")
        for name in names:
            cfg = tm.CONFIGS[name]
            row = dict(scenario=scen, path="triton", config=name, tiles=dataclasses.asdict(cfg))
            call = lambda w=w, ids=ids, cfg=cfg: tm.moe_experts_triton(x, w, ids, gate_up, down, cfg)  # noqa: E731
            rows.append(measure(row, f"{name:12s}", call, want, nbytes))
    return rows


def bench_crossover(gate_up, down, g) -> list[dict]:
    """Grouped vs Triton (the tiles `triton_moe.config_for` picks) as the rows grow: where library.moe_experts
    should stop dispatching to Triton (its _TRITON_MAX_PAIRS_PER_EXPERT; N=8192 is 512 pairs per expert)."""
    nbytes = (gate_up.numel() + down.numel()) * 2
    rows = []
    print(
        f"\n[crossover] tiles by config_for (denoise {tm.DEFAULT_CONFIG!r} up to 32 pairs/expert), uniform routing"
    )
    for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        x = torch.randn(n, H, generator=g, device=DEV, dtype=torch.bfloat16)
        w, ids = routing("uniform", None, g, n)
        row = dict(n=n, pairs_per_expert=n * K / E)
        try:
            for path, fn in (("grouped", library.moe_experts_grouped), ("triton", tm.moe_experts_triton)):
                ms = time_graph(lambda fn=fn, x=x, w=w, ids=ids: fn(x, w, ids, gate_up, down))
                row[f"{path}_ms"] = ms
            print(
                f"  N={n:5d} ({n * K / E:5.0f} pairs/expert)  grouped {row['grouped_ms']:7.3f} ms"
                f"  triton {row['triton_ms']:7.3f} ms  ({tbps(nbytes, row['triton_ms']):.2f} TB/s)"
            )
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"  N={n:5d} FAILED {row['error']}")
        rows.append(row)
    return rows


def _config_name(cfg: tm.MoeConfig) -> str:
    return next(name for name, c in tm.CONFIGS.items() if c is cfg)


def bench_quant(fmts: list[str], gate_up, down, g) -> list[dict]:
    """Each quantized candidate (`triton_moe.QUANT_CANDIDATES`) on gate_up / down quantized on the GPU, against the
    bf16 tiles `config_for` picks on the bf16 weights, at a denoise step (N=256) and a prefill chunk (N=4096),
    uniform routing, bf16 activations on every candidate, fp32 ones on the denoise pick and SPLIT3_CONFIG. TB/s counts the packed bytes read once
    (the parts' nbytes); max|diff| and rel are against dequantize-then-matmul (the grouped path on the weights
    dequantized to bf16; for fp32 activations torch_ref on them in fp32)."""
    rows = []
    inputs = {}
    print("\n[quant] uniform routing")
    for n in (N, 4096):
        x = torch.randn(n, H, generator=g, device=DEV, dtype=torch.bfloat16)
        w, ids = routing("uniform", None, g, n)
        inputs[n] = x, w, ids
        cfg = tm.config_for(ids.numel(), E)
        nbytes = (gate_up.numel() + down.numel()) * 2
        ms = time_graph(
            lambda x=x, w=w, ids=ids, cfg=cfg: tm.moe_experts_triton(x, w, ids, gate_up, down, cfg)
        )
        row = dict(
            n=n, fmt="bf16", act="bf16", config=_config_name(cfg), bytes=nbytes, ms=ms, tbps=tbps(nbytes, ms)
        )
        rows.append(row)
        print(f"  N={n:5d} bf16 {row['config']:18s} {ms:7.3f} ms  {tbps(nbytes, ms):5.2f} TB/s")
    for fmt in fmts:
        qg, qd = QuantWeight.quantize(gate_up, fmt), QuantWeight.quantize(down, fmt)
        nbytes = qg.nbytes + qd.nbytes
        print(f"  {fmt}: {nbytes / 1e9:.3f} GB of packed experts a layer")
        for n, (x, w, ids) in inputs.items():
            for act in ("bf16", "fp32"):
                xa = x if act == "bf16" else x.float() + 1e-3 * torch.randn(x.shape, generator=g, device=DEV)
                if act == "bf16":
                    want = library.moe_experts_grouped(
                        xa, w, ids, qg.dequantize(xa.dtype), qd.dequantize(xa.dtype)
                    )
                else:
                    want = ref.moe_experts(xa, w, ids, qg.dequantize(xa.dtype), qd.dequantize(xa.dtype))
                picked = _config_name(tm.config_for_weights(ids.numel(), xa, qg))
                names = tm.QUANT_CANDIDATES if act == "bf16" else [tm.SPLIT3_CONFIG, tm.QUANT_CONFIG[fmt]]
                for name in names:
                    cfg = tm.CONFIGS[name]
                    row = dict(n=n, fmt=fmt, act=act, config=name, picked=name == picked, bytes=nbytes)
                    row["tiles"] = dataclasses.asdict(cfg)
                    call = lambda xa=xa, w=w, ids=ids, cfg=cfg, qg=qg, qd=qd: tm.moe_experts_triton(  # noqa: E731
                        xa, w, ids, qg, qd, cfg
                    )
                    label = f"N={n:5d} {fmt} {act} {name:18s}{'*' if row['picked'] else ' '}"
                    rows.append(measure(row, label, call, want, nbytes))
    return rows


def _read(parts: list[torch.Tensor]) -> tuple:
    """A plain read of these tensors' bytes (an amax over each, viewed as int32 where its size allows)."""
    out = []
    for t in parts:
        flat = t.reshape(-1).view(torch.uint8)
        out.append(flat.view(torch.int32).amax() if flat.numel() % 4 == 0 else flat.amax())
    return tuple(out)


def bench_gluon(fmts: list[str], gate_up, down, g) -> list[dict]:
    """The register-operand kernels (`gluon_moe`) on the pre-shuffled experts against the quantized Triton kernels'
    pick (`config_for_weights`), at a denoise step (N=256), uniform and skewed routing, beside a plain read of the
    same packed bytes (both layouts): the whole call, then each kernel alone, at each L2 prefetch distance.
    max|diff| and rel against dequantize-then-matmul (the grouped path on the weights dequantized to bf16)."""
    from diffgemma.kernels import gluon_moe as gm
    from diffgemma.kernels import moe_shuffle

    rows = []
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    for fmt in fmts:
        qg, qd = QuantWeight.quantize(gate_up, fmt), QuantWeight.quantize(down, fmt)
        sg, sd = moe_shuffle.shuffle(qg), moe_shuffle.shuffle(qd)
        packed = qg.nbytes + qd.nbytes
        shuffled = sg.nbytes + sd.nbytes
        parts = [*qg.parts.values(), *qd.parts.values()]
        read_ms = time_graph(lambda parts=parts: _read(parts))
        sparts = [t for t in (sg.data, sg.scale, sg.zero, sd.data, sd.scale, sd.zero) if t is not None]
        sread_ms = time_graph(lambda sparts=sparts: _read(sparts))
        print(
            f"\n[gluon {fmt}] packed {packed / 1e9:.3f} GB a layer (shuffled {shuffled / 1e9:.3f} GB); plain read"
            f" {read_ms:.3f} ms {tbps(packed, read_ms):.2f} TB/s, of the shuffled copy {sread_ms:.3f} ms"
            f" {tbps(shuffled, sread_ms):.2f} TB/s"
        )
        rows.append(dict(fmt=fmt, path="read", bytes=packed, ms=read_ms, tbps=tbps(packed, read_ms)))
        rows.append(
            dict(fmt=fmt, path="read_shuffled", bytes=shuffled, ms=sread_ms, tbps=tbps(shuffled, sread_ms))
        )
        for scen in ("uniform", "skewed"):
            w, ids = routing(scen, None, g)
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            print(f"  [{scen}] pairs per expert: max {int(counts.max())}")
            want = library.moe_experts_grouped(x, w, ids, qg.dequantize(x.dtype), qd.dequantize(x.dtype))
            cfg = tm.config_for_weights(ids.numel(), x, qg)
            row = dict(fmt=fmt, scenario=scen, path="triton", config=_config_name(cfg), bytes=packed)
            call = lambda w=w, ids=ids, cfg=cfg, qg=qg, qd=qd: tm.moe_experts_triton(x, w, ids, qg, qd, cfg)  # noqa: E731
            rows.append(measure(row, f"triton {_config_name(cfg):14s}", call, want, packed))
            perm, bounds = tm.sort_pairs(ids, E)
            act = tm.gate_up_act(x, qg, perm, bounds, K, cfg.gate_up)
            ms_g = time_graph(
                lambda t=cfg.gate_up, qg=qg, p=perm, b=bounds: tm.gate_up_act(x, qg, p, b, K, t)
            )
            ms_d = time_graph(lambda t=cfg.down, qd=qd, a=act, b=bounds: tm.down_sorted(a, qd, b, t))
            print(
                f"    triton gate_up {ms_g * 1e3:6.1f} us {tbps(qg.nbytes, ms_g):.2f} TB/s, down"
                f" {ms_d * 1e3:6.1f} us {tbps(qd.nbytes, ms_d):.2f} TB/s"
            )
            row.update(gate_up_ms=ms_g, down_ms=ms_d)
            for pf in (0, 4, 8):
                row = dict(fmt=fmt, scenario=scen, path="gluon", prefetch=pf, bytes=packed)

                def call(w=w, ids=ids, pf=pf, sg=sg, sd=sd):
                    perm, bounds = tm.sort_pairs(ids, E)
                    a = torch.empty(perm.shape[0], INTER, device=DEV, dtype=x.dtype)
                    gm._launch(x, sg, a, perm, bounds, K, True, pf)
                    y = torch.empty(perm.shape[0], H, device=DEV, dtype=x.dtype)
                    gm._launch(a, sd, y, perm, bounds, 1, False, pf)
                    return ref.sum_sorted_pairs(y, perm, w).to(x.dtype)

                rows.append(measure(row, f"gluon prefetch {pf}      ", call, want, packed))
                if "ms" not in row:
                    continue
                a = torch.empty(perm.shape[0], INTER, device=DEV, dtype=x.dtype)
                y = torch.empty(perm.shape[0], H, device=DEV, dtype=x.dtype)
                ms_g = time_graph(
                    lambda pf=pf, w=sg, out=a, p=perm, b=bounds: gm._launch(x, w, out, p, b, K, True, pf)
                )
                ms_d = time_graph(
                    lambda pf=pf, w=sd, a=act, out=y, p=perm, b=bounds: gm._launch(
                        a, w, out, p, b, 1, False, pf
                    )
                )
                print(
                    f"    gluon gate_up {ms_g * 1e3:6.1f} us {tbps(qg.nbytes, ms_g):.2f} TB/s, down"
                    f" {ms_d * 1e3:6.1f} us {tbps(qd.nbytes, ms_d):.2f} TB/s"
                )
                row.update(gate_up_ms=ms_g, down_ms=ms_d)
    return rows


def sweep_tma_tiles() -> list[tm.Tiles]:
    """The weights through TMA descriptors, 32 x 2 pairs (the best pointer-load shape): N and K blocks,
    stages (within ~200 KB of shared memory for gate_up's two weight tiles and x's), plain or swapped MMA."""
    out = []
    for bn, bk, stages, swap in itertools.product((64, 128), (64, 128, 256), (3, 4, 5), (False, True)):
        if 2 * stages * (32 * bk + 2 * bn * bk) > 200 * 1024:
            continue
        out.append(tm.Tiles(32, bn, bk, num_stages=stages, m_slots=2, swap_ab=swap, tma=True))
    return out


def sweep_tiles() -> list[tm.Tiles]:
    """~70 shapes around the named configs: (block_m, m_slots) in 16x1, 32x1, 16x2, 32x2, the N and K blocks,
    warps 4/8 (8 only with 64+ columns), 3/4 stages (3 only for the larger tiles), plain or swapped MMA."""
    out = []
    for (bm, slots), bn, bk, warps, swap in itertools.product(
        ((16, 1), (32, 1), (16, 2), (32, 2)), (32, 64, 128), (64, 128, 256), (4, 8), (False, True)
    ):
        if (bn == 128 and bk == 256) or (warps == 8 and bn == 32) or (warps == 8 and swap):
            continue
        stages = 3 if bn * bk >= 128 * 128 or bm == 32 else 4
        out.append(tm.Tiles(bm, bn, bk, num_warps=warps, num_stages=stages, m_slots=slots, swap_ab=swap))
    return out


def bench_sweep(gate_up, down, x, g, only: str | None = None, tma: bool = False) -> list[dict]:
    """Each kernel alone (uniform routing) over a grid of tile shapes (`only`: one of them, m_slots 2; `tma`:
    the TMA grid)."""
    w, ids = routing("uniform", None, g)
    perm, bounds = tm.sort_pairs(ids, E)
    act = tm.gate_up_act(x, gate_up, perm, bounds, K, tm.Tiles())
    kernels = {
        "gate_up": (gate_up.numel() * 2, lambda t: tm.gate_up_act(x, gate_up, perm, bounds, K, t)),
        "down": (down.numel() * 2, lambda t: tm.down_sorted(act, down, bounds, t)),
    }
    rows = []
    tiles = sweep_tma_tiles() if tma else sweep_tiles()
    if only:
        kernels = {only: kernels[only]}
        tiles = [t for t in tiles if t.m_slots == 2]
    for kname, (nbytes, launch) in kernels.items():
        print(f"\n[sweep {kname}] {len(tiles)} tile shapes")
        ref_out = launch(tm.Tiles())
        for t in tiles:
            row = dict(kernel=kname, tiles=dataclasses.asdict(t))
            try:
                diff = (launch(t).float() - ref_out.float()).abs().max().item()
                ms = time_graph(lambda t=t, launch=launch: launch(t))
                row.update(ms=ms, tbps=tbps(nbytes, ms), max_abs_diff=diff)
                print(f"  {t}  {ms:7.3f} ms  {tbps(nbytes, ms):5.2f} TB/s  max|diff| {diff:.3g}")
            except Exception as e:  # noqa: BLE001
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                print(f"  {t}  FAILED {row['error']}")
            rows.append(row)
        ok = sorted((r for r in rows if r["kernel"] == kname and "ms" in r), key=lambda r: r["ms"])
        for r in ok[:5]:
            print(f"  best: {r['ms']:.3f} ms {r['tbps']:.2f} TB/s {r['tiles']}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=",".join(tm.CONFIGS), help="comma-separated names from CONFIGS")
    p.add_argument("--ids", default=None, help="torch.save'd routing ids [256, 8] to bench as well")
    p.add_argument("--sweep", action="store_true", help="also time each kernel over a grid of tiles")
    p.add_argument("--sweep-only", choices=("gate_up", "down"), help="sweep this kernel alone, m_slots 2")
    p.add_argument("--tma", action="store_true", help="sweep the weights-through-TMA tile grid instead")
    p.add_argument(
        "--quant", default=None, help="comma-separated formats (int4, fp8): time the quantized experts"
    )
    p.add_argument(
        "--quant-only", action="store_true", help="with --quant: skip the bf16 configs and crossover"
    )
    p.add_argument(
        "--gluon",
        action="store_true",
        help="with --quant: the register-operand kernels (gluon_moe) against the Triton pick, instead",
    )
    args = p.parse_args()

    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    nbytes = (gate_up.numel() + down.numel()) * 2
    print(f"{torch.cuda.get_device_name()}  expert weights {nbytes / 1e9:.3f} GB per layer")

    floor_ms = time_graph(lambda: (gate_up.amax(), down.amax()))
    print(f"read floor (amax over the weights): {floor_ms:.3f} ms  {tbps(nbytes, floor_ms):.2f} TB/s")

    scenarios = ["uniform", "skewed"] + (["file"] if args.ids else [])
    result = dict(
        device=torch.cuda.get_device_name(),
        shape=dict(N=N, k=K, E=E, H=H, I=INTER),
        weight_bytes=nbytes,
        default_config=tm.DEFAULT_CONFIG,
        floor=dict(ms=floor_ms, tbps=tbps(nbytes, floor_ms)),
    )
    if not (args.quant and args.quant_only):
        result["results"] = bench_configs(args.configs.split(","), scenarios, args, gate_up, down, x, g)
        result["crossover"] = bench_crossover(gate_up, down, g)
    if args.sweep:
        result["sweep"] = bench_sweep(gate_up, down, x, g, args.sweep_only, args.tma)
    if args.quant and args.gluon:
        result["gluon"] = bench_gluon(args.quant.split(","), gate_up, down, g)
    elif args.quant:
        result["quant"] = bench_quant(args.quant.split(","), gate_up, down, g)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "moe_kernels.json"
        write_json(path, result, indent=1)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
