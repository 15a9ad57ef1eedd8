"""Each fast CUDA op pinned to its torch reference on the device (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import cuda as fast
from diffgemma.kernels import torch_ref as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n", [256, 4096])
def test_moe_grouped_matches_reference(n):
    torch.manual_seed(n)
    e, h, i, k = 128, 2816, 704, 8
    x = torch.randn(n, h, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(e, 2 * i, h, device=DEV, dtype=torch.bfloat16) * h**-0.5
    dn = torch.randn(e, h, i, device=DEV, dtype=torch.bfloat16) * i**-0.5
    w, ids = ref.route(
        x,
        torch.randn(e, h, device=DEV, dtype=torch.bfloat16) * 0.1,
        torch.ones(h, device=DEV, dtype=torch.bfloat16),
        torch.rand(e, device=DEV) + 0.5,
        k,
        1e-6,
    )
    want = ref.moe_experts(x.double(), w.double(), ids, gu.double(), dn.double())
    got = fast.moe_experts(x, w, ids, gu, dn)
    assert rel(got, want) < 1e-2
    assert rel(ref.moe_experts(x, w, ids, gu, dn), want) < 1e-2


@pytest.mark.parametrize("hd,hkv,s", [(256, 8, 1279), (512, 2, 33024)])
def test_attention_nomask_matches_reference(hd, hkv, s):
    q = torch.randn(1, 16, 256, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    k = torch.randn(1, hkv, s, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    v = torch.randn(1, hkv, s, hd, device=DEV, dtype=torch.bfloat16)
    want = ref.attention(q.float(), k.float(), v.float(), None)
    assert rel(fast.attention_nomask(q, k, v), want) < 1e-2


def test_attention_window_and_causal_past_match_reference():
    t, past, w = 4096, 1023, 1024
    for hd, hkv, sliding in [(256, 8, True), (512, 2, False)]:
        p = past if sliding else 9000
        q = torch.randn(1, 16, t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        k = torch.randn(1, hkv, p + t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        v = torch.randn(1, hkv, p + t, hd, device=DEV, dtype=torch.bfloat16)
        qpos = torch.arange(20000, 20000 + t, device=DEV)
        kpos = torch.arange(20000 - p, 20000 + t, device=DEV)
        mask = kpos[None] <= qpos[:, None]
        if sliding:
            mask &= kpos[None] > qpos[:, None] - w
            got = fast.attention_window(q, k, v, qpos, kpos, w)
        else:
            got = fast.attention_causal_past(q, k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:])
        want = ref.attention(q.float(), k.float(), v.float(), mask)
        assert rel(got, want) < 1e-2, (hd, sliding)


def test_graphed_denoise_matches_eager(tmp_path):
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    m = load_model(write_tiny_checkpoint(tmp_path / "c", seed=3), DEV, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.cfg.vocab_size, (1, 40), generator=g)
    canvas = torch.randint(0, m.cfg.vocab_size, (1, m.cfg.canvas_length), generator=g)
    kv = m.new_cache(128)
    m.prefill(prompt, kv)
    m.fast = False
    want = m.denoise(canvas, kv)
    sc = torch.softmax(want[0] / 0.7, -1)
    want_sc = m.denoise(canvas, kv, sc_probs=sc)
    m.fast = True
    for _ in range(2):  # capture, then replay
        assert rel(m.denoise(canvas, kv), want) < 5e-2
        assert rel(m.denoise(canvas, kv, sc_probs=sc), want_sc) < 5e-2
