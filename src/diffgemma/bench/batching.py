"""N requests at once through the scheduler: aggregate tok/s, ms a step, batch invariance."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from diffgemma.bench.options import BenchOptions
from diffgemma.bench.report import log
from diffgemma.bench.shapes import GIB
from diffgemma.bench.timing import _sync, fixed_steps_sampler
from diffgemma.config import ModelConfig
from diffgemma.model.kv_cache import cache_bytes, ring_slots
from diffgemma.runner.runner import ModelRunner

CONCURRENT_BLOCKS = 4  # blocks a request in `concurrency`


def concurrency_bytes(cfg: ModelConfig, n: int, prompt: int, dtype: torch.dtype) -> int:
    """Bytes that n concurrent requests of `prompt` tokens hold beside the weights: a KV cache each (`concurrency`'s
    size) and the batched pass's [n * C, V] buffers: its logits (`DenoiseGraphs.batch_out`), its SC input
    (`DenoiseGraphs.batch_sc`) and the sampler's SC output the next step reads. Activations come on top."""
    c = cfg.canvas_length
    max_tokens = prompt + (CONCURRENT_BLOCKS + 1) * c
    kv = cache_bytes(cfg, max_tokens, dtype, ring_slots(cfg, max_tokens))
    return n * (kv + 3 * c * cfg.vocab_size * torch.empty((), dtype=dtype).element_size())


def concurrency(runner: ModelRunner, opts: BenchOptions, ns: list[int], g) -> dict[str, Any]:
    """N requests started together through the `Scheduler` (each a `gen_prompt`-token prompt, CONCURRENT_BLOCKS
    blocks of `fixed_steps` steps, early stops off): aggregate generated tok/s, mean ms a scheduler step (one denoise
    step of every running canvas, and the commits due), peak GPU memory. Prompt prefill is excluded, as in
    `generate_tok_s`. For the largest N, each request is then run alone on its cache: `solo_equal` is the share of
    requests whose tokens equal their solo run's (batch invariance, measured). `planned_gib`: `concurrency_bytes`
    (the caches and the batched buffers, beside the weights); an N that runs out of memory is reported so and the
    next one runs."""
    from diffgemma.engine.generate import Turn, drive

    cfg, device = runner.model.cfg, runner.device
    c, steps = cfg.canvas_length, max(opts.fixed_steps, 1)
    sampler = fixed_steps_sampler(steps)
    res: dict[str, Any] = {}
    for n in ns:
        planned = concurrency_bytes(cfg, n, opts.gen_prompt, runner.dtype) / GIB
        oom = None
        try:
            caches, prompts, turns, sched, count, wall = _run_together(runner, opts, n, max(ns), sampler, g)
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        if oom is not None:  # out of the handler: its traceback no longer holds the caches
            res[str(n)] = {"skipped": f"out of memory: {oom}", "planned_gib": planned}
            log(f"diffgemma: {n} concurrent: out of memory (planned {planned:.1f} GiB beside the weights)")
            runner.release_graphs()
            gc.collect()
            runner.return_memory()
            continue
        tokens = sum(len(t.out.token_ids) for t in turns)
        row = res[str(n)] = {
            "tok_s": tokens / wall,
            "step_ms": wall / count * 1e3,
            "canvases_per_forward": max(sched.forwards) if sched.forwards else 0,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
            "planned_gib": planned,
        }
        if opts.data_parallel > 1:  # every rank ran n requests on its replica: the sum is the N GPUs' rate
            total = torch.tensor([row["tok_s"]], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(total)
            row["tok_s_all_ranks"] = float(total)
        if "step_ms" in res.get("1", {}) and n > 1:
            row["ms_per_added_canvas"] = (row["step_ms"] - res["1"]["step_ms"]) / (n - 1)
            row["speedup"] = row["tok_s"] / res["1"]["tok_s"]
        if n == max(ns) and n > 1:
            batched = [t.out.token_ids for t in turns]
            solo = []
            for kv, prompt in zip(caches, prompts, strict=True):
                kv.reset()
                turn = Turn(runner, prompt, kv, sampler, seed=1, max_new_tokens=CONCURRENT_BLOCKS * c)
                solo.append(drive(turn).token_ids)
            row["solo_equal"] = sum(a == b for a, b in zip(batched, solo, strict=True)) / n
            row["solo_equal_tokens"] = sum(
                x == y for a, b in zip(batched, solo, strict=True) for x, y in zip(a, b, strict=False)
            ) / max(1, sum(len(a) for a in batched))
        log(
            f"diffgemma: {n} concurrent: {row['tok_s']:,.0f} tok/s, {row['step_ms']:.2f} ms a step, "
            f"{row['canvases_per_forward']} canvases a forward, peak {row['peak_gib'] or 0:.1f} GiB"
            + (f", {row['solo_equal']:.0%} of requests equal their solo run" if "solo_equal" in row else "")
        )
        del turns, sched, caches
        gc.collect()
    return res


def _run_together(runner: ModelRunner, opts: BenchOptions, n: int, max_batch: int, sampler, g):
    """n requests through one `Scheduler`, twice (the first: warm-up, compiles and graph captures) on a cache each
    kept across the two, as a server keeps its conversations' (the graphs the warm-up captures, each tied to its
    caches, serve the timed run). Returns (caches, prompts, turns, scheduler, steps, seconds) of the timed run."""
    from diffgemma.engine.batch import Request, Scheduler
    from diffgemma.engine.generate import Turn

    cfg, device, c = runner.model.cfg, runner.device, runner.model.cfg.canvas_length
    caches = [runner.new_cache(opts.gen_prompt + (CONCURRENT_BLOCKS + 1) * c) for _ in range(n)]
    for rep in range(2):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sched = Scheduler(runner, max_batch=max_batch)
        prompts = [torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist() for _ in caches]
        turns = []
        for kv, prompt in zip(caches, prompts, strict=True):
            kv.reset()
            turns.append(Turn(runner, prompt, kv, sampler, seed=rep, max_new_tokens=CONCURRENT_BLOCKS * c))
        for turn in turns:
            sched.submit(Request(turn))
        _sync(device)
        t0, count = time.perf_counter(), 0
        while sched.active:
            sched.step()
            count += 1
        _sync(device)
        wall = time.perf_counter() - t0
    return caches, prompts, turns, sched, count, wall
