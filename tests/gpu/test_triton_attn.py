"""The attention kernels of kernels/triton_attn.py at a sliding layer's real shapes (split-KV: a denoise step;
window rows: a prefill chunk), in bf16, against float64 and against SDPA (skipped without CUDA or triton)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diffgemma.kernels import dispatch
from diffgemma.kernels import library as fast

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


def _want_window(q: torch.Tensor, past: torch.Tensor, chunk: torch.Tensor, window: int) -> torch.Tensor:
    """float64 rows [T, H * d] of query t (position n + t) over the keys at n + t - window < p <= n + t, a head
    at a time (4096 x 5119 scores: 168 MB)."""
    _, h, t, d = q.shape
    n, g = past.shape[2], h // past.shape[1]
    kv = torch.cat([past, chunk], dim=2)
    qpos, kpos = torch.arange(n, n + t, device=DEV)[:, None], torch.arange(n + t, device=DEV)[None]
    hidden = (kpos > qpos) | (kpos <= qpos - window)
    out = torch.empty(t, h, d, device=DEV, dtype=torch.float64)
    for head in range(h):
        k, v = kv[:, head // g].double()
        s = (q[0, head].double() @ k.T).masked_fill(hidden, float("-inf"))
        out[:, head] = torch.softmax(s, dim=-1) @ v
    return out.reshape(t, h * d)


@pytest.mark.parametrize("n", [0, 1023])
def test_window_rows_match_reference_and_sdpa(n, monkeypatch):
    """A 4096-token chunk after no cached positions and after a full window (1023), past a strided view of a
    longer cache: `library.attention_window` (the Triton kernel) against float64 and against its SDPA path."""
    torch.manual_seed(n)
    h, hkv, t, d, w = 16, 8, 4096, 256, 1024
    q = torch.randn(1, h, t, d, device=DEV, dtype=torch.bfloat16) * d**-0.25
    cache = torch.randn(2, hkv, 1100, d, device=DEV, dtype=torch.bfloat16)
    chunk = torch.randn(2, hkv, t, d, device=DEV, dtype=torch.bfloat16)
    cache[0] *= d**-0.25
    chunk[0] *= d**-0.25
    past = cache[:, :, 40 : 40 + n]
    bias = fast.window_bias(n, t, w, h // hkv, q.dtype, DEV)
    got = fast.attention_window(q, past, chunk, bias)
    assert "triton_attn" not in dispatch.failed
    assert got.shape == (t, h * d) and got.dtype == torch.bfloat16
    assert torch.equal(got, ta.attention_window_rows(q, past, chunk, w))  # it was the Triton kernel
    monkeypatch.setattr(dispatch, "failed", dispatch.failed | {"triton_attn"})  # the gate now serves SDPA
    sdpa = fast.attention_window(q, past, chunk, bias)
    want = _want_window(q, past, chunk, w)
    sdpa_err = float((sdpa.double() - want).abs().max())
    assert float((got.double() - want).abs().max()) <= 2 * sdpa_err + 1e-6
    assert _rel(got, sdpa) < 1e-2


def test_ragged_equals_each_canvas_lone_call_bit_for_bit():
    """kernels/triton_ragged at the sliding shape: three canvases on three caches of unlike slot counts and
    spans (a full window, a short one, one past a ring's start) give, bit for bit, each canvas's lone split-KV call
    with a span of n_max keys (the per-canvas path the batched pass took before), and the float64 softmax."""
    from diffgemma.kernels import triton_ragged as tr
    from diffgemma.model.steps import kv_tables

    torch.manual_seed(0)
    d, hkv, g, t, n_max = 256, 8, 2, 256, 1279
    bufs = [torch.randn(2, hkv, slots, d, device=DEV, dtype=torch.bfloat16) for slots in (1400, 3583, 2000)]
    for buf in bufs:
        buf[0] *= d**-0.25
    spans = ((0, 1279), (2000, 300), (100, 1100))
    geometry = torch.zeros(3, 5, dtype=torch.int32, device=DEV)
    geometry[:, 1:3] = torch.tensor(spans, dtype=torch.int32)
    q = torch.randn(3, hkv * g, t, d, device=DEV, dtype=torch.bfloat16) * d**-0.25
    qf = q.reshape(3, hkv, g * t, d)
    table = kv_tables([type("Cache", (), {"kv": [buf]})() for buf in bufs])[0].to(DEV)
    rows = torch.empty(3 * t, hkv * g, d, device=DEV, dtype=torch.bfloat16)
    out = rows.view(3, t, hkv, g, d).permute(0, 2, 3, 1, 4)
    tr.attention_ragged(qf, table, geometry, n_max, hkv, out)
    for b, (buf, (first, count)) in enumerate(zip(bufs, spans, strict=True)):
        lone = ta.attention_splitkv(qf[b : b + 1], buf[0:1], buf[1:2], span=(geometry[b, 1:3].clone(), n_max))
        assert torch.equal(out[b].reshape(1, hkv, g * t, d), lone), b
        want = _want(qf[b : b + 1], buf[0:1, :, first : first + count], buf[1:2, :, first : first + count])
        assert _rel(lone, want) < 1e-2


def test_ragged_norm_rope_equals_each_canvas_lone_call_bit_for_bit():
    from tests.test_triton_ragged_interpret import check_norm_rope_ragged

    check_norm_rope_ragged(torch.bfloat16, DEV, 256)
