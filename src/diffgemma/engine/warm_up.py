"""Warm-up: the fast path compiled (and on CUDA captured) before the first request, by generating throwaway
replies. It lives with the engine because it generates; the runner only offers what it needs (`fast`,
`new_cache`, `release_graphs`, `return_memory`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from diffgemma.config import SamplerConfig
from diffgemma.engine.generate import generate

if TYPE_CHECKING:
    from diffgemma.runner.runner import ModelRunner


def warm_up(runner: ModelRunner, sampler: SamplerConfig) -> float:
    """Compile the fast path (torch.compile'd regions and Triton kernels, once a process) by generating throwaway
    replies on caches of their own: a short prompt (prefilled under the sampler's fp32 rule when it is on) and one
    just past that rule's length (prefilled in the model's dtype), two blocks of three steps each, so that the
    denoise step with each self-conditioning input and a block's commit run too. Then the graphs tied to those
    caches are dropped. A server calls it before it takes requests, as vLLM compiles and captures before serving
    (docs/performance.md, "torch.compile and warm-up"). Returns the seconds taken; 0.0 on the reference kernels,
    where nothing is compiled."""
    if not runner.fast:
        return 0.0
    t0 = time.perf_counter()
    canvas, vocab = runner.cfg.canvas_length, runner.cfg.vocab_size
    sampler = sampler.replace(max_denoising_steps=3, stop_token_ids=(), empty_reply_retry=0)
    f32_max = sampler.prefill_f32_max_tokens
    for n in (min(8, f32_max), f32_max + 1) if f32_max else (8,):
        ids = [3 + i % (vocab - 3) for i in range(n)]  # past pad, eos and bos
        kv = runner.new_cache(n + 3 * canvas)
        generate(runner, ids, kv, sampler, seed=0, max_new_tokens=2 * canvas)
        del kv
    runner.release_graphs()
    runner.return_memory()
    return time.perf_counter() - t0
