"""The batched denoise pass on the GPU (skipped without CUDA): with the sliding layers' attention of all canvases in
one ragged launch, and their Q/K norms and RoPE, every canvas's logits are those of the per-canvas kernels bit for
bit, eager and replayed from the set's graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_ragged_attention_gives_the_per_canvas_logits(monkeypatch):
    import diffgemma
    from diffgemma.kernels import dispatch
    from diffgemma.runner.runner import DenoiseInput
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda")
    runner = eng.runner
    g = torch.Generator().manual_seed(0)
    caches = []
    for n in (40, 700, 1500):  # below the window, about it, past it (a ring's wrap)
        kv = runner.new_cache(2048)
        runner.prefill(torch.randint(3, runner.cfg.vocab_size, (n,), generator=g).tolist(), kv)
        caches.append(kv)
    c, v = runner.cfg.canvas_length, runner.cfg.vocab_size
    canvas = torch.randint(0, v, (3, c), generator=g).cuda()
    probs = torch.softmax(torch.randn(3 * c, v, generator=g).cuda() * 3, -1).to(runner.dtype)
    inputs = [
        DenoiseInput(canvas[b], kv, probs[b * c : (b + 1) * c], False, False) for b, kv in enumerate(caches)
    ]
    calls = []
    from diffgemma.kernels import triton_ragged

    real = triton_ragged.attention_ragged
    monkeypatch.setattr(
        triton_ragged, "attention_ragged", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    ragged = [runner.denoise_many(inputs).clone() for _ in range(3)]  # eager, captured, replayed
    assert calls and dispatch.failed.isdisjoint({"triton_ragged"})
    monkeypatch.setattr(runner, "graphs_on", False)
    monkeypatch.setattr(dispatch, "failed", {"triton_ragged"})  # the per-canvas kernels
    lone = runner.denoise_many(inputs)
    for got in ragged:
        assert torch.equal(got, lone)
    assert not torch.equal(lone[0], lone[1])
