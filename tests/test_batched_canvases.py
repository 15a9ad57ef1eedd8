"""Many canvases in one pass (the reference kernels, any batch): B rows, each after its own cache, equal B passes
of one row, for denoise with and without self-conditioning and for prefill."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import RuntimeConfig
from diffgemma.runner.runner import DenoiseInput, ModelRunner
from diffgemma.weights.loader import load_model
from tests.conftest import rel

LENGTHS = (5, 19, 40)  # three caches of different lengths: past the tiny model's window, and not


@torch.no_grad()
def _caches(model, g):
    caches = []
    for n in LENGTHS:
        kv = model.new_cache(256)
        model.prefill(torch.randint(3, model.cfg.vocab_size, (1, n), generator=g), kv)
        caches.append(kv)
    return caches


@torch.no_grad()
def test_three_canvases_on_three_caches_equal_three_single_calls(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    caches = _caches(model, g)
    c, v = model.cfg.canvas_length, model.cfg.vocab_size
    canvas = torch.randint(0, v, (len(LENGTHS), c), generator=g)
    probs = torch.softmax(torch.randn(len(LENGTHS), c, v, generator=g) * 3, dim=-1)
    for sc in ({}, {"sc_probs": probs}, {"sc_seed": True}):
        batched = model.denoise(canvas, caches, **sc)
        assert batched.shape == (len(LENGTHS), c, v)
        for b, kv in enumerate(caches):
            one = {"sc_probs": probs[b]} if "sc_probs" in sc else dict(sc)
            single = model.denoise(canvas[b : b + 1], kv, **one)
            assert (batched[b] - single[0]).abs().max() <= 1e-5, (sc.keys(), b)
        # and the rows are not all alike: each one read its own cache
        assert (batched[0] - batched[1]).abs().max() > 1e-3
    assert [kv.length for kv in caches] == list(LENGTHS)  # denoise reads the caches, never writes


@torch.no_grad()
def test_batched_prefill_after_three_caches_equals_three_single_prefills(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    batched, single = (
        _caches(model, torch.Generator().manual_seed(1)),
        _caches(model, torch.Generator().manual_seed(1)),
    )
    ids = torch.randint(
        3, model.cfg.vocab_size, (len(LENGTHS), 12), generator=torch.Generator().manual_seed(2)
    )
    model.prefill(ids, batched)
    for b, kv in enumerate(single):
        model.prefill(ids[b : b + 1], kv)
    for kv_b, kv_s, n in zip(batched, single, LENGTHS, strict=True):
        assert kv_b.length == kv_s.length == n + 12
        for layer in range(model.cfg.num_layers):
            (kb, vb, pb), (ks, vs, ps) = kv_b.read(layer), kv_s.read(layer)
            assert torch.equal(pb, ps)
            assert (kb - ks).abs().max() <= 1e-5 and (vb - vs).abs().max() <= 1e-5


@torch.no_grad()
def test_fast_kernels_run_three_canvases_in_one_pass_as_three_lone_ones(tiny_a):
    """`ModelRunner.denoise_many` on the fast kernels (CPU, fp32): each canvas's logits those of its lone pass, for
    each SC input; the CPU's grouped expert GEMM sums in a row-count-dependent order, ~1e-5 after the layers."""
    runner = ModelRunner(
        load_model(tiny_a, "cpu", torch.float32), RuntimeConfig(kernels="fast", compile=False)
    )
    g = torch.Generator().manual_seed(3)
    caches = []
    for n in LENGTHS:
        kv = runner.new_cache(256)
        runner.prefill(torch.randint(3, runner.cfg.vocab_size, (n,), generator=g).tolist(), kv)
        caches.append(kv)
    c, v = runner.cfg.canvas_length, runner.cfg.vocab_size
    canvas = torch.randint(0, v, (len(LENGTHS), c), generator=g)
    probs = torch.softmax(torch.randn(len(LENGTHS), c, v, generator=g) * 3, dim=-1)
    for sc in (
        {"probs": None, "seed": False},
        {"probs": probs, "seed": False},
        {"probs": None, "seed": True},
    ):
        inputs = []
        for b, kv in enumerate(caches):
            p = None if sc["probs"] is None else sc["probs"][b]
            inputs.append(DenoiseInput(canvas[b], kv, p, sc["seed"], False))
        many = runner.denoise_many(inputs)
        for b, x in enumerate(inputs):
            one = runner.denoise(canvas[b : b + 1], x.kv, sc_probs=x.probs, sc_seed=x.seed, raw=True)
            assert rel(many[b], one[0]) < 1e-5, (sc["seed"], b)
        assert rel(many[0], many[1]) > 1e-2  # each read its own cache
    assert [kv.length for kv in caches] == list(LENGTHS)
    with pytest.raises(ValueError, match="one length"):
        runner.denoise_many([inputs[0], DenoiseInput(canvas[1, :8], caches[1], None, False, False)])
