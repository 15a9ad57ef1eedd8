"""bf16 runs on CPU and tracks fp32; short prompts can prefill with fp32 activations (seed §3 / §9 #7)."""

from __future__ import annotations

import torch

from diffgemma.weights.loader import load_model


@torch.no_grad()
def test_bf16_tracks_fp32_and_f32_prefill_is_closer(tiny_a):
    f32 = load_model(tiny_a, "cpu", torch.float32)
    bf16 = load_model(tiny_a, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1000, (1, 30), generator=g)
    canvas = torch.randint(3, 1000, (1, 16), generator=g)
    kv32, kv16, kv16f = f32.new_cache(64), bf16.new_cache(64), bf16.new_cache(64)
    f32.prefill(prompt, kv32)
    bf16.prefill(prompt, kv16)
    bf16.prefill(prompt, kv16f, compute_dtype=torch.float32)
    assert kv16.dtype == kv16f.dtype == torch.bfloat16

    def kv_err(kv):
        return max(
            (kv.read(i)[0].float() - kv32.read(i)[0]).abs().max().item() for i in range(f32.cfg.num_layers)
        )

    assert kv_err(kv16f) < kv_err(kv16)
    a = f32.denoise(canvas, kv32)
    b = bf16.denoise(canvas, kv16f)
    assert b.dtype == torch.float32
    assert (
        torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95
    )  # random routers flip experts under bf16 noise
