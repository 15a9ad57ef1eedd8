"""The split-KV attention (kernels/triton_attn.py) at a sliding layer's real denoise shape, in bf16, against
float64 and against SDPA (skipped without CUDA or triton)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ta = pytest.importorskip("diffgemma.kernels.triton_attn", reason="needs triton")

from tests.test_triton_attn_interpret import _rel, _want  # noqa: E402 - after the skip without triton

DEV = "cuda"


def _inputs(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, 16, 256, 256] folded to [1, 8, 512, 256]; k/v the first s slots of a [2, 8, 1400, 256] cache."""
    d = 256
    q = torch.randn(1, 16, 256, d, device=DEV, dtype=torch.bfloat16) * d**-0.25
    cache = torch.randn(2, 8, 1400, d, device=DEV, dtype=torch.bfloat16)
    cache[0] *= d**-0.25
    return q.reshape(1, 8, 512, d), cache[:1, :, :s], cache[1:, :, :s]


def test_splitkv_matches_reference_and_sdpa():
    torch.manual_seed(0)
    q, k, v = _inputs(1279)
    want = _want(q, k, v)
    got = ta.attention_splitkv(q, k, v)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    sdpa_err = float((sdpa.double() - want).abs().max())
    assert float((got.double() - sdpa.double()).abs().max()) <= 2 * sdpa_err + 1e-6
    assert torch.equal(ta.attention_splitkv(q, k, v), got)  # a fixed summation order: the same bits


def test_splitkv_with_an_empty_split():
    torch.manual_seed(1)
    q, k, v = _inputs(1279)
    # 20 key blocks of 64 in 8 splits of 3 blocks: 7 splits cover them, the 8th gets none
    assert math.ceil(1279 / 64) == 20 and math.ceil(20 / math.ceil(20 / 8)) == 7
    got = ta.attention_splitkv(q, k, v, splits=8, block_n=64)
    assert _rel(got, _want(q, k, v)) < 1e-2
