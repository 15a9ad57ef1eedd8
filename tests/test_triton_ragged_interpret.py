"""kernels/triton_ragged.py (the sliding layers' denoise attention of several canvases in one launch, each after
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
    from diffgemma.kernels import triton_ragged as tr
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


def check_norm_rope_ragged(dtype: torch.dtype, device: str, t: int) -> None:
    """`triton_ragged.norm_rope_ragged` of three canvases, each into its own cache buffer (unlike slot counts) at
    its own canvas slot, bit for bit each canvas's lone `triton_qkv.norm_rope` into a copy of its cache, for both
    layer kinds (sliding: own V; full: V = the raw K); nothing else of the buffers written (also run by
    tests/gpu)."""
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_qkv as tq
    from diffgemma.kernels import triton_ragged as tr
    from diffgemma.model.steps import kv_tables

    g = torch.Generator(device=device).manual_seed(2)
    kinds = ((16, 4, 2, True, (1e4, "default", 1.0)), (32, 4, 1, False, (1e6, "proportional", 0.25)))
    if device == "cuda":
        kinds = ((256, 16, 8, True, (1e4, "default", 1.0)), (512, 16, 2, False, (1e6, "proportional", 0.25)))
    starts = (0, 57, 301)
    for hd, nq, nkv, has_v, rope in kinds:
        heads = nq + nkv * (2 if has_v else 1)
        qkv = torch.randn(3 * t, heads * hd, generator=g, device=device).to(dtype) * 3
        qn, kn = (1 + 0.3 * torch.randn(hd, generator=g, device=device).to(dtype) for _ in range(2))
        inv = ref.rope_inv_freq(hd, *rope).to(device)
        pos = torch.cat([torch.arange(s, s + t, device=device) for s in starts])
        cos, sin = ref.rope_cos_sin(inv, pos, dtype)
        bufs = [torch.zeros(2, nkv, n, hd, device=device, dtype=dtype) for n in (t + 5, t + 70, t + 400)]
        alone = [buf.clone() for buf in bufs]
        slots = torch.tensor([[2], [60], [333]], dtype=torch.int32, device=device)
        table = kv_tables([types.SimpleNamespace(kv=[buf]) for buf in bufs])[0].to(device)
        q = tr.norm_rope_ragged(qkv, 3, nq, nkv, has_v, cos, sin, qn, kn, 1e-6, table, slots[:, 0])
        assert q.shape == (3, nq, t, hd) and q.is_contiguous()
        for b in range(3):
            rows = slice(b * t, (b + 1) * t)
            q1, _ = tq.norm_rope(
                qkv[rows], nq, nkv, has_v, cos[rows], sin[rows], qn, kn, 1e-6, alone[b], kv_slot=slots[b]
            )
            assert torch.equal(q[b : b + 1], q1), (hd, b)
            assert torch.equal(bufs[b], alone[b]), (hd, b)
            s0 = int(slots[b, 0])
            assert float(alone[b][:, :, s0 : s0 + t].abs().max()) > 0  # the canvas's slots written
            assert float(alone[b][:, :, :s0].abs().max()) == 0 == float(alone[b][:, :, s0 + t :].abs().max())


def _check_norm_rope() -> None:
    check_norm_rope_ragged(torch.float32, "cpu", 20)
    check_norm_rope_ragged(torch.float16, "cpu", 20)


@pytest.mark.parametrize("check", ["_check_ragged", "_check_norm_rope"])
def test_ragged_kernels_under_interpreter(check: str):
    run_under_interpreter("tests.test_triton_ragged_interpret", check)
