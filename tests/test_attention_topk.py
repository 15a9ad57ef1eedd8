"""The seed's top-k sparse full-layer attention (`torch_ref.attention_topk`, `RuntimeConfig.attention_topk`) on the
reference kernels: pinned to a per-row brute force, dense where a row has at most k keys, ties to the lower key.
The fast kernels' (kernels/triton_topk.py) are pinned to it in tests/test_triton_topk_interpret.py and on a GPU
in tests/gpu/test_topk_fast.py."""

from __future__ import annotations

import math

import pytest
import torch

from diffgemma.config import RuntimeConfig
from diffgemma.kernels import torch_ref as ref
from diffgemma.runner.runner import ModelRunner
from diffgemma.weights.loader import load_model


def test_topk_keys_is_the_seeds_clamp():
    assert [ref.topk_keys(n) for n in (10, 8192, 12_800, 131_072, 1 << 20)] == [64, 64, 100, 512, 512]


def _brute(q, k, v, mask, keep):
    """Row by row: the keep best allowed keys by (score desc, index asc), softmax over them, P.V (fp64)."""
    h, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for head in range(h):
        kh, vh = k[0, head // (h // hkv)].double(), v[0, head // (h // hkv)].double()
        for i in range(q.shape[2]):
            s = (kh @ q[0, head, i].double()).tolist()
            allowed = [j for j in range(len(s)) if mask is None or bool(mask[i, j])]
            best = sorted(allowed, key=lambda j: (-s[j], j))[:keep]
            w = torch.tensor([math.exp(s[j] - max(s[b] for b in best)) for j in best], dtype=torch.float64)
            out[0, head, i] = (w / w.sum()) @ vh[best]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_topk_is_the_brute_force(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 9, 8, generator=g),
        torch.randn(1, 2, 30, 8, generator=g),
        torch.randn(1, 2, 30, 8, generator=g),
    )
    mask = (torch.arange(30)[None] <= torch.arange(21, 30)[:, None]) if causal else None
    for keep in (1, 5, 12):
        got = ref.attention_topk(q, k, v, mask, keep)
        torch.testing.assert_close(got.double(), _brute(q, k, v, mask, keep), rtol=1e-5, atol=1e-5)
    dense = ref.attention(q, k, v, mask)
    torch.testing.assert_close(ref.attention_topk(q, k, v, mask, 30), dense, rtol=1e-5, atol=1e-6)
    assert (ref.attention_topk(q, k, v, mask, 5) - dense).abs().max() > 1e-3  # sparse is not dense


def test_ties_at_the_threshold_go_to_the_lower_key():
    q = torch.ones(1, 1, 1, 4)
    k = torch.ones(1, 1, 6, 4)  # every key scores the same
    v = torch.arange(6.0).reshape(1, 1, 6, 1).expand(1, 1, 6, 4).contiguous()
    got = ref.attention_topk(q, k, v, None, 2)
    assert torch.allclose(got, torch.full((1, 1, 1, 4), 0.5))  # keys 0 and 1, equally weighted


@torch.no_grad()
def test_the_option_runs_the_full_layers_top_k(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    dense = ModelRunner(model, RuntimeConfig(kernels="reference"))
    g = torch.Generator().manual_seed(4)
    c = model.cfg.canvas_length
    canvas = torch.randint(3, model.cfg.vocab_size, (1, c), generator=g)
    for n, same in ((20, True), (200, False)):  # 20 + c keys <= 64: dense; 200 + c: 64 of them
        kv = dense.new_cache(512)
        dense.prefill(torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist(), kv)
        want = dense.denoise(canvas, kv)
        sparse = ModelRunner(model, RuntimeConfig(kernels="reference", attention_topk=True))
        got = sparse.denoise(canvas, kv)
        assert torch.equal(got, want) if same else (got - want).abs().max() > 1e-4
        dense = ModelRunner(model, RuntimeConfig(kernels="reference"))  # its kernels back on the model


def test_the_fast_kernels_take_it_on_a_cuda_device_only(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(model, RuntimeConfig(kernels="fast", attention_topk=True))


def test_the_fast_kernels_torch_fallback_is_the_reference():
    """`library._attend_topk` without Triton (the CPU, or a failed kernel): the reference on materialized scores,
    with each row limit (valid keys and k from their count, a prefill block's causal rows, a commit's tail)."""
    from diffgemma.kernels import library

    g = torch.Generator().manual_seed(8)
    hkv, grp, t, d, s = 2, 2, 5, 16, 400
    q = torch.randn(1, hkv * grp, t, d, generator=g)
    k, v = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    scores = library._bmm_fp32(q.reshape(hkv, grp * t, d), k[0].transpose(1, 2))
    rows = torch.arange(t)[:, None]
    cases = [  # (keep, limits, the reference's keys and mask)
        (None, dict(valid=torch.tensor([300], dtype=torch.int32)), 300, None),
        (64, dict(causal=(390, t)), s, torch.arange(s)[None] < 390 + rows),
        (
            64,
            dict(valid=torch.tensor([200], dtype=torch.int32), tail=t),
            200,
            torch.arange(200)[None] <= 195 + rows,
        ),
    ]
    for keep, limits, n, mask in cases:
        out = torch.empty(hkv, grp, t, d)
        library._attend_topk(scores, v[0], out, keep, **limits)
        want = ref.attention_topk(q, k[:, :, :n], v[:, :, :n], mask, keep or ref.topk_keys(n))
        assert torch.allclose(out.reshape(1, hkv * grp, t, d), want, atol=1e-5), limits
