"""kernels/triton_attn_ragged.py (the sliding layers' denoise attention of several canvases in one launch, each after
its own cache) under Triton's CPU interpreter: bit for bit the per-canvas `triton_attn.attention_splitkv` call with
a span, as the batched pass ran it before, and near a float64 softmax(q k^T) v. Skipped without triton."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from tests.test_triton_interpret import _rel, run_under_interpreter  # noqa: E402 - after the skip without triton


def _check_ragged() -> None:
    """Three canvases on three caches of different slot counts (another allocation each), spans of different
    starts and counts (one shorter than a key block, one of n_max keys), q a slice of a longer tensor; splits of 1,
    3 and the lone canvas's automatic choice; fp32 and fp16 (rounded by the interpreter as on the GPU)."""
    from diffgemma.kernels import triton_attn as ta
    from diffgemma.kernels import triton_attn_ragged as tr
    from diffgemma.model.steps import kv_tables

    g = torch.Generator().manual_seed(0)
    hkv, grp, t, d, n_max = 2, 2, 20, 64, 150
    m = grp * t
    spans = ((7, 150), (0, 20), (40, 101))
    for dtype in (torch.float32, torch.float16):
        bufs = [torch.randn(2, hkv, slots, d, generator=g).to(dtype) for slots in (160, 230, 190)]
        for buf in bufs:
            buf[0] *= d**-0.25 * 2  # scores of sd ~4
        q = (torch.randn(3, hkv, m + 3, d, generator=g)[:, :, :m] * d**-0.25 * 2).to(dtype)
        geometry = torch.zeros(3, 5, dtype=torch.int32)
        geometry[:, 1:3] = torch.tensor(spans, dtype=torch.int32)
        table = kv_tables([types.SimpleNamespace(kv=[buf]) for buf in bufs])[0]
        for splits in (1, 3, None):
            out = torch.full((3, hkv, grp, t, d), float("nan"), dtype=dtype)
            got = tr.attention_ragged(q, table, geometry, n_max, hkv, out, splits, block_m=16, block_n=32)
            assert got.data_ptr() == out.data_ptr()
            for b, (buf, (first, count)) in enumerate(zip(bufs, spans, strict=True)):
                lone = ta.attention_splitkv(
                    q[b : b + 1],
                    buf[0:1],
                    buf[1:2],
                    splits,
                    block_m=16,
                    block_n=32,
                    span=(geometry[b, 1:3].clone(), n_max),
                )
                mine = out[b].reshape(1, hkv, m, d)
                assert torch.equal(mine, lone), (dtype, splits, b)
                k, v = buf[0:1, :, first : first + count], buf[1:2, :, first : first + count]
                want = torch.softmax(q[b : b + 1].double() @ k.double().transpose(-1, -2), -1) @ v.double()
                assert _rel(mine, want) < (1e-5 if dtype == torch.float32 else 2e-3), (dtype, splits, b)
    with pytest.raises(ValueError, match="out must be"):
        tr.attention_ragged(q, table, geometry, n_max, hkv, out[:2])
    with pytest.raises(ValueError, match="table"):
        tr.attention_ragged(q, table[:2], geometry, n_max, hkv, out)


def test_ragged_attention_under_interpreter():
    run_under_interpreter("tests.test_triton_attn_ragged_interpret", "_check_ragged")
