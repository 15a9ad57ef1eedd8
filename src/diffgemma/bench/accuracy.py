"""Errors measured: each layer's output and the logits against a reference (quantized, top-k)."""

from __future__ import annotations

import gc
from typing import Any

import torch

from diffgemma.bench.report import log
from diffgemma.model.model import DiffusionGemma
from diffgemma.runner.runner import ModelRunner


@torch.no_grad()
def layer_outputs(model: DiffusionGemma, prompt: torch.Tensor, canvas: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's output over a denoise of `canvas` after prefilling `prompt` (through the model's own kernel
    table, eagerly), then the final logits."""
    cache = model.new_cache(prompt.shape[1] + 2 * canvas.shape[1])
    model.prefill(prompt, cache)
    return denoise_layers(model, canvas, cache)


def quant_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any]:
    """Per-layer and final relative error (Frobenius) of the quantized model against bf16, and the logits' argmax
    agreement."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {
        "layer_rel_err": [rel(a, b) for a, b in zip(got[:-1], ref[:-1], strict=True)],
        "logits_rel_err": rel(got[-1], ref[-1]),
        "argmax_agreement": float((got[-1].argmax(-1) == ref[-1].argmax(-1)).float().mean()),
    }


def denoise_layers(model: DiffusionGemma, canvas: torch.Tensor, cache) -> list[torch.Tensor]:
    """Each layer's output over a denoise of `canvas` on a prefilled `cache` (the model's steps, eagerly;
    the cache's length is left as it was), then the final logits."""
    outs: list[torch.Tensor] = []
    real = model.layer_forward

    def record(*args, **kwargs):
        h, x = real(*args, **kwargs)
        outs.append(h.float())
        return h, x

    model.layer_forward = record
    try:
        outs.append(model.denoise(canvas, cache, sc_seed=True).float())
    finally:
        del model.layer_forward
    return outs


def topk_error(runner: ModelRunner, ctxs: list[int], g) -> dict[str, Any]:
    """Top-k sparse against dense full-layer attention on the same weights, at each context: a denoise step after
    one dense prefill, on the reference kernels with `attention_topk` on and off (per-layer and final relative
    error, argmax agreement); beside it the fast kernels' dense step against the reference's, the yardstick of
    what two exact paths differ by."""
    from diffgemma.kernels.torch_ref import topk_keys
    from diffgemma.model.steps import Steps

    model, c = runner.model, runner.cfg.canvas_length
    fast = model.steps
    res: dict[str, Any] = {}
    for ctx in ctxs:
        prompt = torch.randint(0, runner.cfg.vocab_size, (1, ctx), generator=g).to(runner.device)
        canvas = torch.randint(0, runner.cfg.vocab_size, (1, c), generator=g).to(runner.device)
        cache = runner.new_cache(ctx + 2 * c)
        runner.prefill(prompt, cache)
        outs = {}
        try:
            for name, kernels in (("fast", fast), ("dense", Steps()), ("topk", Steps(topk=True))):
                model.steps = kernels
                outs[name] = denoise_layers(model, canvas, cache)
        finally:
            model.steps = fast
        row = res[str(ctx)] = {
            "keep": topk_keys(ctx + c),
            "topk_vs_dense": quant_error(outs["topk"], outs["dense"]),
            "fast_vs_reference": quant_error(outs["fast"], outs["dense"]),
        }
        log(
            f"top-k at {ctx}: keeps {row['keep']} of {ctx + c} keys; logits relative error "
            f"{row['topk_vs_dense']['logits_rel_err']:.4f} against dense, argmax agreement "
            f"{row['topk_vs_dense']['argmax_agreement']:.3f} (the fast kernels against the reference: "
            f"{row['fast_vs_reference']['logits_rel_err']:.4f}, {row['fast_vs_reference']['argmax_agreement']:.3f})"
        )
        del outs, cache
        gc.collect()
    return res
