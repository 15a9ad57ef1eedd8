"""The attention kernels of kernels/triton_attn.py (split-KV, sliding-window prefill) run by Triton's CPU
interpreter at small shapes against a float64 softmax(q k^T) v. Skipped without triton.

As in tests/test_triton_interpret.py, the check runs in a subprocess started with TRITON_INTERPRET=1: the
interpreter must be on before triton wraps a kernel, and it stays out of this pytest process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.test_triton_interpret import _rel, run_under_interpreter  # noqa: E402 - after the skip without triton


def _want(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q.double() @ k.double().transpose(-1, -2), dim=-1) @ v.double()


def _check_attn() -> None:
    """M = 40 and S = 300, multiples of neither tile; q, k and v strided views (k and v two slices of one
    cache tensor); one split, uneven splits, and more splits than key blocks (the last ones get no keys).
    fp32 pins the indexing and the split merge; fp16 (rounded by the interpreter as on the GPU) the rounding
    of P before P @ V. bf16 is left to tests/gpu: the interpreter truncates it."""
    from diffgemma.kernels import triton_attn as ta

    g = torch.Generator().manual_seed(0)
    hkv, m, s, d = 2, 40, 300, 64
    q = torch.randn(1, hkv, m + 5, d, generator=g)[:, :, :m] * d**-0.25 * 2  # scores of sd ~4
    cache = torch.randn(2, hkv, s + 7, d, generator=g)
    cache[0] *= d**-0.25 * 2
    k, v = cache[:1, :, 3 : 3 + s], cache[1:, :, 3 : 3 + s]
    want = _want(q, k, v)
    # 10 key blocks of 32: splits of 10, of 4/4/2, of 1 (10 of the 16 non-empty)
    for splits, block_m in ((1, 16), (3, 32), (16, 16), (None, 32)):
        got = ta.attention_splitkv(q, k, v, splits, block_m=block_m, block_n=32)
        assert got.shape == (1, hkv, m, d) and got.dtype == q.dtype and got.is_contiguous()
        assert _rel(got, want) < 1e-5, (splits, _rel(got, want))

    # out: the [T, H, d] rows o_proj reads, seen as [Hkv, g, T, d] (here g = 4 heads a KV head, T = 10)
    rows = torch.full((10, hkv * 4, d), float("nan"))
    got = ta.attention_splitkv(
        q, k, v, 3, block_m=16, block_n=32, out=rows.view(10, hkv, 4, d).permute(1, 2, 0, 3)
    )
    assert got.data_ptr() == rows.data_ptr()
    assert _rel(rows.view(10, hkv, 4, d).permute(1, 2, 0, 3).reshape(1, hkv, m, d), want) < 1e-5
    with pytest.raises(ValueError, match="out must be"):
        ta.attention_splitkv(q, k, v, out=rows[:5].view(5, hkv, 4, d).permute(1, 2, 0, 3))

    # span: the keys read on the device from a slot range of the whole cache, tiled for at most n_max keys
    both = cache[:, :, None]  # [2, Hkv, 1, slots, d]: k and v as [1, Hkv, slots, d] views of the cache
    for first, count, n_max in ((3, s, s), (0, 37, s), (5, 290, s + 2)):
        span = (torch.tensor([first, count], dtype=torch.int32), n_max)
        got = ta.attention_splitkv(
            q, both[0, :, 0][None], both[1, :, 0][None], 3, block_m=16, block_n=32, span=span
        )
        want_span = _want(q, cache[:1, :, first : first + count], cache[1:, :, first : first + count])
        assert _rel(got, want_span) < 1e-5, (first, count, _rel(got, want_span))
    with pytest.raises(ValueError, match="span must be"):
        ta.attention_splitkv(q, k, v, span=(torch.tensor([0, 4]), 4))

    q16, k16, v16 = (t.half() for t in (q, k, v))
    got = ta.attention_splitkv(q16, k16, v16, 3, block_m=16, block_n=32)
    assert got.dtype == torch.float16 and _rel(got, _want(q16, k16, v16)) < 2e-3, _rel(
        got, _want(q16, k16, v16)
    )

    with pytest.raises(ValueError, match="power of two"):
        ta.attention_splitkv(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="dtypes differ"):
        ta.attention_splitkv(q, k16, v16)
    with pytest.raises(ValueError, match="want q"):
        ta.attention_splitkv(q, k[:, :1], v[:, :1])


def _want_window(q: torch.Tensor, past: torch.Tensor, chunk: torch.Tensor, window: int) -> torch.Tensor:
    """float64 rows [T, H * d] of query t (position n + t) over the keys at n + t - window < p <= n + t."""
    _, h, t, d = q.shape
    n = past.shape[2]
    kv = torch.cat([past, chunk], dim=2).double().repeat_interleave(h // past.shape[1], dim=1)
    qpos, kpos = torch.arange(n, n + t)[:, None], torch.arange(n + t)[None]
    seen = (kpos <= qpos) & (kpos > qpos - window)
    s = (q[0].double() @ kv[0].transpose(-1, -2)).masked_fill(~seen, float("-inf"))
    return (torch.softmax(s, dim=-1) @ kv[1]).transpose(0, 1).reshape(t, h * d)


def _check_window() -> None:
    """Window 50 against tiles of 16 and 32, so that key blocks straddle the past/chunk boundary and the
    window's edges, and a query block's 49 + block_m keys (65 or 81) spill one key into their last key block
    (one block fewer would miss it): the first chunk (n = 0, T = 70 a multiple of no tile), a full window
    (n = 49) and a partial one (n = 10). q a slice of a longer one, past a strided view of a [2, S, Hkv, d]
    cache. fp32 pins the indexing and masks, fp16 the rounding of P."""
    from diffgemma.kernels import triton_attn as ta

    g = torch.Generator().manual_seed(0)
    h, hkv, d, w = 4, 2, 64, 50
    for n, t, block_m, block_n in ((0, 70, 16, 32), (w - 1, 37, 32, 16), (10, 100, 16, 16)):
        q = torch.randn(1, h, t + 3, d, generator=g)[:, :, :t] * d**-0.25 * 2  # scores of sd ~4
        cache = torch.randn(2, 60, hkv, d, generator=g).permute(0, 2, 1, 3)
        cache[0] *= d**-0.25 * 2
        past = cache[:, :, 5 : 5 + n]
        chunk = torch.randn(2, hkv, t, d, generator=g)
        chunk[0] *= d**-0.25 * 2
        want = _want_window(q, past, chunk, w)
        got = ta.attention_window_rows(q, past, chunk, w, block_m=block_m, block_n=block_n)
        assert got.shape == (t, h * d) and got.dtype == q.dtype
        assert _rel(got, want) < 1e-5, (n, t, _rel(got, want))

    q16, past16, chunk16 = q.half(), past.half(), chunk.half()
    got = ta.attention_window_rows(q16, past16, chunk16, w, block_m=32, block_n=32)
    want = _want_window(q16, past16, chunk16, w)
    assert got.dtype == torch.float16 and _rel(got, want) < 2e-3, _rel(got, want)

    with pytest.raises(ValueError, match="window sees at most"):
        ta.attention_window_rows(q, past, chunk, 10)
    with pytest.raises(ValueError, match="dtypes differ"):
        ta.attention_window_rows(q, past16, chunk16, w)
    with pytest.raises(ValueError, match="power of two"):
        ta.attention_window_rows(q[..., :48], past[..., :48], chunk[..., :48], w)
    with pytest.raises(ValueError, match="want q"):
        ta.attention_window_rows(q, past, chunk[:, :, 1:], w)


@pytest.mark.parametrize("check", ["_check_attn", "_check_window"])
def test_attention_kernels_under_interpreter(check: str):
    """attention_splitkv (_check_attn) and attention_window_rows (_check_window) under the interpreter."""
    run_under_interpreter("tests.test_triton_attn_interpret", check)
