"""Prefill tok/s and denoise step ms at each context, a fixed-step generation, peak memory."""

from __future__ import annotations

import time
from typing import Any

import torch

from diffgemma.bench.options import BenchOptions
from diffgemma.bench.shapes import GIB
from diffgemma.bench.timing import OursRunner, _fits, _median, _sync, timed
from diffgemma.config import ModelConfig


def measure(
    runner, ctxs: list[int], opts: BenchOptions, device: torch.device, need_bytes, log
) -> dict[str, Any]:
    """Prefill tok/s and denoise step ms at each context, a fixed-step generation and peak memory, by `runner`
    (ours or another engine's behind the same interface)."""
    model = runner.model
    cfg = model.cfg
    c = cfg.canvas_length
    g = torch.Generator().manual_seed(1)
    res: dict[str, Any] = {"denoise_step_ms": {}, "prefill_tok_s": {}, "skipped": {}}
    canvas = torch.randint(0, cfg.vocab_size, (1, c), generator=g).to(device)
    sc_logits = (torch.randn(1, c, cfg.vocab_size, generator=g) * 4).to(device)
    limits = opts.max_context or {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ctx in ctxs:
        ok, why = _fits(device, need_bytes(ctx))
        if not ok or ctx > limits.get(runner.name, 1 << 30):
            res["skipped"][str(ctx)] = (
                why if not ok else f"above {runner.name}'s largest context (device time)"
            )
            log(f"{runner.name}: skip {ctx}: {res['skipped'][str(ctx)]}")
            continue
        try:
            runner.new_cache(ctx)
            ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g)
            runner.prefill(ids[:, : min(ctx, 4096)])  # warm-up: same kernels, short
            ms = timed(lambda ids=ids: runner.prefill(ids), device, 0, opts.reps)
            res["prefill_tok_s"][str(ctx)] = ctx / (_median(ms) / 1e3)
            if runner.name == OursRunner.name:
                t0 = time.perf_counter()  # first call: graph capture (+ inductor compile the first time)
                runner.denoise(canvas, sc_logits)
                _sync(device)
                res.setdefault("denoise_first_call_s", {})[str(ctx)] = time.perf_counter() - t0
            ms = timed(lambda: runner.denoise(canvas, sc_logits), device, opts.warmup, opts.reps)
            res["denoise_step_ms"][str(ctx)] = _median(ms)
            log(
                f"{runner.name} ctx {ctx}: prefill {res['prefill_tok_s'][str(ctx)]:,.0f} tok/s, "
                f"denoise {res['denoise_step_ms'][str(ctx)]:.2f} ms (min {min(ms):.2f}, max {max(ms):.2f})"
            )
        except torch.OutOfMemoryError as e:
            res["skipped"][str(ctx)] = f"out of memory: {str(e).splitlines()[0]}"
            log(f"{runner.name}: ctx {ctx} OOM")
        runner.new_cache(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if opts.gen_steps > 0:
        prompt = torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist()
        runner.generate(prompt, opts.gen_steps, c)  # warm-up
        ms = timed(lambda: runner.generate(prompt, opts.gen_steps, c), device, 0, opts.gen_reps)
        res["generate_block_s"] = _median(ms) / 1e3
        res["generate_setup"] = f"prompt {opts.gen_prompt} tokens, {c}-token canvas, {opts.gen_steps} steps"
        log(f"{runner.name}: generate {c} tokens: {res['generate_block_s']:.3f} s")
    if opts.fixed_steps > 0 and runner.name == OursRunner.name:
        res.update(generate_rate(runner, cfg, opts, device, g))
        log(
            f"{runner.name}: {opts.fixed_steps} steps a block: {res['generate_tok_s']:,.0f} tok/s "
            f"({res['generate_tok_s_with_prefill']:,.0f} with the prompt's prefill)"
        )
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    if runner.name == OursRunner.name:
        from diffgemma.kernels import regions

        res["fast_kernels"] = runner.runner.fast
        if runner.runner.fast:
            res["fused_regions"] = regions.regions_report(model.steps.regions)
    runner.new_cache(0)
    return res


def generate_rate(runner, cfg: ModelConfig, opts: BenchOptions, device: torch.device, g) -> dict[str, Any]:
    """Tokens a second of one block at `opts.fixed_steps` steps, early stops off: the canvas over its denoise
    steps plus its commit (the committed block prefilled into the cache), prefill of the prompt excluded as vLLM
    reports it; and with the prompt's prefill."""
    c = cfg.canvas_length
    prompt = torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist()
    rows = []
    for i in range(opts.gen_reps + 1):  # the first: warm-up (graph capture)
        out = runner.generate(prompt, opts.fixed_steps, c)
        t0 = time.perf_counter()
        runner.runner.prefill(torch.tensor([out.token_ids], device=device), runner.kv)  # the commit
        _sync(device)
        if i:
            rows.append((out.prefill_seconds, out.denoise_seconds, time.perf_counter() - t0))
    prefill, denoise, commit = (_median([r[j] for r in rows]) for j in range(3))
    return {
        "generate_tok_s": c / (denoise + commit),
        "generate_tok_s_with_prefill": c / (prefill + denoise + commit),
        "generate_fixed_setup": f"prompt {opts.gen_prompt} tokens, {c}-token canvas, {opts.fixed_steps} steps, "
        f"early stops off; denoise {denoise * 1e3:.1f} ms + commit {commit * 1e3:.1f} ms, "
        f"prompt prefill {prefill * 1e3:.1f} ms",
    }
