"""Timing: CUDA events or perf_counter after warm-up, medians; our runner behind the measuring loop."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from diffgemma.bench.shapes import GIB
from diffgemma.config import SamplerConfig
from diffgemma.runner.runner import ModelRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Milliseconds per call (CUDA events on cuda, perf_counter elsewhere), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def fixed_steps_sampler(steps: int) -> SamplerConfig:
    """Every early stop and re-roll off, no stop tokens: exactly `steps` denoise steps per block."""
    return SamplerConfig(
        max_denoising_steps=steps,
        stability_threshold=0,
        confidence_threshold=1e-30,
        stop_token_ids=(),
        plateau_steps=0,
        pad_gate=False,
        entropy_stop=0.0,
        empty_reply_retry=0,
        commit_conf_trim=0.0,
        pad_block_stop=False,
        prefill_f32_max_tokens=0,
    ).validated()


class OursRunner:
    """Our runner behind the measuring loop's interface: a cache per context, prefill, denoise, generate."""

    name = "diffgemma"

    def __init__(self, runner: ModelRunner):
        self.runner, self.model = runner, runner.model
        self.kv = None

    def new_cache(self, ctx: int):
        self.kv = None
        gc.collect()
        self.kv = self.runner.new_cache(ctx + 2 * self.model.cfg.canvas_length)

    def prefill(self, ids: torch.Tensor) -> None:
        self.kv.reset()
        self.runner.prefill(ids, self.kv)

    def denoise(self, canvas: torch.Tensor, sc_logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(sc_logits[0], dim=-1, dtype=torch.float32)
        return self.runner.denoise(canvas, self.kv, sc_probs=probs)

    def generate(self, prompt: list[int], steps: int, new_tokens: int):
        from diffgemma.engine.generate import generate

        # as Engine.generate does: one cache emptied per call, so its captured graphs serve every call
        if (
            self.kv is None
            or self.kv.max_tokens < len(prompt) + new_tokens + 2 * self.model.cfg.canvas_length
        ):
            self.new_cache(len(prompt) + new_tokens)
        self.kv.reset()
        return generate(self.runner, prompt, self.kv, fixed_steps_sampler(steps), max_new_tokens=new_tokens)


def _fits(device: torch.device, need: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    free, _ = torch.cuda.mem_get_info(device)
    return need < free, f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
