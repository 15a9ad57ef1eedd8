"""The batched training forward pinned to `model.prefill` + `model.denoise` (fp32, max |Δ| <= 1e-4).

The reference model is the training model written with `write_checkpoint` (fp32) and read back by the loader,
so the test also pins the checkpoint writer's tensor names and layout.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from diffgemma.train.checkpoint import (
    build_model,
    full_config,
    generation_config,
    text_config,
    write_checkpoint,
)
from diffgemma.train.forward import train_forward
from diffgemma.weights.loader import load_model

TOL = 1e-4
SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_config(window: int = 8, canvas: int = 16) -> dict:
    tc = text_config(
        512,
        hidden_size=64,
        intermediate_size=96,
        layer_types=(SLIDING, FULL, SLIDING, SLIDING, FULL),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=window,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=24,
    )
    return full_config(tc, canvas)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = tiny_config()
    model = build_model(config, seed=3)
    with torch.no_grad():  # non-trivial norm weights, as after training
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if p.dim() == 1 and "scalar" not in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    path = write_checkpoint(
        model, tmp_path_factory.mktemp("fwd"), config, generation_config(), dtype=torch.float32
    )
    return model, load_model(path, "cpu", torch.float32)


def _reference(model, prompt, canvas, **sc):
    kv = model.new_cache(512)
    model.prefill(prompt[None], kv)
    return model.denoise(canvas[None], kv, **sc)[0]


@pytest.mark.parametrize("moe", ["dense", "sparse"])
def test_batched_forward_matches_prefill_denoise(models, moe):
    model, ref = models
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    c = cfg.canvas_length
    lengths = [3 * cfg.sliding_window + 5, 4, cfg.sliding_window + 1, 1]  # longer and shorter than the window
    p = max(lengths)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), p, dtype=torch.long)
    mask = torch.zeros(len(lengths), p, dtype=torch.bool)
    for i, pr in enumerate(prompts):  # left padding
        ids[i, p - len(pr) :] = pr
        mask[i, p - len(pr) :] = True
    canvas = torch.randint(0, cfg.vocab_size, (len(lengths), c), generator=g)

    with torch.no_grad():
        out = train_forward(model, ids, mask, canvas, moe=moe)
        seed = train_forward(model, ids, mask, canvas, sc_seed=True, moe=moe)
        probs = torch.softmax(out / 0.7, -1)
        sc = train_forward(model, ids, mask, canvas, sc_probs=probs, moe=moe)
    assert (sc - out).abs().max() > 1e-3  # SC really changes the logits
    for i, pr in enumerate(prompts):
        assert (out[i] - _reference(ref, pr, canvas[i])).abs().max() <= TOL
        assert (seed[i] - _reference(ref, pr, canvas[i], sc_seed=True)).abs().max() <= TOL
        assert (sc[i] - _reference(ref, pr, canvas[i], sc_probs=probs[i])).abs().max() <= TOL


def test_forward_is_differentiable(models):
    model, _ = models
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length))
    model.zero_grad()
    logits = train_forward(model, ids, mask, canvas, sc_seed=True)
    logits.logsumexp(-1).mean().backward()
    layer = model.layers[1]
    for p in (
        model.embed,
        model.sc_gate,
        layer.q_proj,
        layer.experts_gate_up,
        layer.router_proj,
        layer.k_norm,
    ):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert model.layers[0].layer_scalar.grad is None  # the layer scalars stay frozen at 1
    model.zero_grad()


def test_compiled_layers_match_eager(models):
    """The trainer's torch.compile'd layer: same logits and gradients as the eager layer, two batch shapes."""
    model, _ = models
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    for b, p in ((2, 12), (3, 20)):  # a second shape must reuse the dynamic-shape compile
        ids = torch.randint(0, cfg.vocab_size, (b, p), generator=g)
        mask = torch.ones(b, p, dtype=torch.bool)
        mask[0, :4] = False
        canvas = torch.randint(0, cfg.vocab_size, (b, cfg.canvas_length), generator=g)
        grads = []
        outs = []
        for compiled in (False, True):
            model.zero_grad()
            logits = train_forward(model, ids, mask, canvas, sc_seed=True, compiled=compiled)
            logits.logsumexp(-1).mean().backward()
            outs.append(logits.detach())
            grads.append(model.layers[1].q_proj.grad.clone())
        assert (outs[0] - outs[1]).abs().max() <= 1e-4
        assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[0].abs().max()
    model.zero_grad()


@pytest.mark.parametrize("sc, seed_first", [(False, False), (True, False), (False, True), (True, True)])
def test_device_flag_choices_match_host_choices(models, sc, seed_first):
    """The graphed trainer's step takes its self-conditioning choices as device flags (one graph for all of
    them): its loss and gradients equal the host-choice step's."""
    from diffgemma.train.batches import Batch
    from diffgemma.train.trainer import loss_on

    model = models[0]
    g = torch.Generator().manual_seed(5)
    b, p, c = 3, 7, 16
    batch = Batch(
        torch.randint(3, 512, (b, p), generator=g),
        torch.ones(b, p, dtype=torch.bool),
        torch.randint(3, 512, (b, c), generator=g),
        torch.rand(b, c, generator=g),
        torch.ones(b, c, dtype=torch.bool),
        torch.full((b, 4), -1, dtype=torch.long),
        torch.zeros(b, p, dtype=torch.bool),
    )
    results = []
    for flags in (False, True):
        choice = (torch.tensor(sc), torch.tensor(seed_first)) if flags else (sc, seed_first)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # the same corruption for both
        loss, stats = loss_on(model, batch, *choice, 0.7, contextlib.nullcontext)
        loss.backward()
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        results.append((loss.detach(), stats, grads))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l0, l1, atol=1e-6, rtol=1e-6), (l0, l1)
    assert torch.allclose(s0, s1, atol=1e-6, rtol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(g0, g1, strict=True)) < 1e-6
    model.zero_grad(set_to_none=True)
