"""The top-k attention kernels of kernels/triton_topk.py run by Triton's CPU interpreter against the torch
reference (`torch_ref.attention_topk`) and the seed's selection rule (a stable sort: ties to the lower key).
Skipped without triton; run in a subprocess with TRITON_INTERPRET=1, as tests/test_triton_interpret.py says why."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.test_triton_interpret import _rel, run_under_interpreter  # noqa: E402 - after the skip without triton


def _kept(scores: torch.Tensor, keep: int, limits: torch.Tensor) -> list[list[int]]:
    """Each row's kept columns, ascending: its `keep` best below its limit, ties to the lower column."""
    out = []
    for row, limit in zip(scores.reshape(-1, scores.shape[-1]), limits.reshape(-1).tolist(), strict=True):
        order = torch.sort(row[:limit], descending=True, stable=True).indices
        out.append(sorted(order[:keep].tolist()))
    return out


def _got(idx: torch.Tensor, counts: torch.Tensor) -> list[list[int]]:
    return [
        r[:c].tolist()
        for r, c in zip(idx.reshape(-1, idx.shape[-1]), counts.reshape(-1).tolist(), strict=True)
    ]


def _check_topk() -> None:
    """Hkv = 2 heads of g = 2 query heads and T = 6 queries; S = 300 keys (one partial block), then 9,100 keys with
    9,000 valid (k from the valid count on the device: 70), causal rows as a prefill block has them, a commit's
    causal tail, and scores with ties at the threshold. The kept columns equal the seed's rule's; the output equals
    `torch_ref.attention_topk`'s in fp32 and, with fp16 values, to fp16's rounding."""
    from diffgemma.kernels import library
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_topk as tt

    g = torch.Generator().manual_seed(0)
    hkv, grp, t, d = 2, 2, 6, 64
    h = hkv * grp

    def run(q, k, v, keep, **limits):
        scores = library._bmm_fp32(q.reshape(hkv, grp * t, d), k[0].transpose(1, 2))
        idx, p, sums, counts = tt.select_rows(scores, keep, **limits)
        out = torch.empty(hkv, grp, t, d, dtype=v.dtype)
        tt.gather_pv(idx, p, sums, counts, v[0], out)
        return scores, idx, counts, out.reshape(1, h, t, d)

    for s_len, valid in ((300, None), (9100, 9000)):
        q = torch.randn(1, h, t, d, generator=g)
        k = torch.randn(1, hkv, s_len, d, generator=g) * 0.5
        v = torch.randn(1, hkv, s_len, d, generator=g)
        n = s_len if valid is None else valid
        keep = ref.topk_keys(n)
        kw = {} if valid is None else {"valid": torch.tensor([valid], dtype=torch.int32)}
        scores, idx, counts, out = run(q, k, v, 64 if valid is None else None, **kw)
        assert _got(idx, counts) == _kept(scores, keep, torch.full(scores.shape[:-1], n))
        want = ref.attention_topk(q, k[:, :, :n], v[:, :, :n], None, keep)
        assert _rel(out, want) < 1e-5, (s_len, _rel(out, want))

    # causal: row r of each head keeps its first base + r % t columns (a prefill block of t queries after 250 keys)
    s_len, base = 256, 251
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, s_len, d, generator=g) * 0.5
    v = torch.randn(1, hkv, s_len, d, generator=g)
    scores, idx, counts, out = run(q, k, v, 64, causal=(base, t))
    limits = (base + torch.arange(grp * t) % t).expand(hkv, grp * t)
    assert _got(idx, counts) == _kept(scores, 64, limits)
    mask = torch.arange(s_len)[None, :] < base + torch.arange(t)[:, None]
    want = ref.attention_topk(q, k, v, mask, 64)
    assert _rel(out, want) < 1e-5, _rel(out, want)

    # a commit's tail: the last t of 200 valid keys are the queries, each seeing the keys up to its own
    valid = torch.tensor([200], dtype=torch.int32)
    scores, idx, counts, out = run(q, k, v, 64, valid=valid, tail=t)
    limits = (200 - t + 1 + torch.arange(grp * t) % t).expand(hkv, grp * t)
    assert _got(idx, counts) == _kept(scores, 64, limits)
    mask = torch.arange(200)[None, :] < 200 - t + 1 + torch.arange(t)[:, None]
    want = ref.attention_topk(q, k[:, :, :200], v[:, :, :200], mask, 64)
    assert _rel(out, want) < 1e-5, _rel(out, want)

    # ties: scores in steps of 1/4 over 100 columns, so that the 64th score is shared by several columns
    ties = (torch.randint(0, 12, (hkv, grp * t, 100), generator=g) / 4).float()
    idx, p, sums, counts = tt.select_rows(ties, 64)
    assert _got(idx, counts) == _kept(ties, 64, torch.full(ties.shape[:-1], 100))
    assert torch.equal(counts, torch.full_like(counts, 64))
    kept = torch.stack([ties[i, j][idx[i, j, :64].long()] for i in range(hkv) for j in range(grp * t)])
    assert torch.allclose(sums.reshape(-1), torch.exp(kept - ties.amax(-1).reshape(-1, 1)).sum(-1))

    # fp16 values: the products in fp32, one rounding of the output
    v16 = v.half()
    _, _, _, out = run(q, k, v16, 64, causal=(base, t))
    want = ref.attention_topk(
        q, k, v16.float(), mask=torch.arange(s_len)[None, :] < base + torch.arange(t)[:, None], keep=64
    )
    assert out.dtype == torch.float16 and _rel(out, want) < 1e-3, _rel(out, want)

    with pytest.raises(ValueError, match="keep=None reads"):
        tt.select_rows(scores, None)
    with pytest.raises(ValueError, match="keep must lie"):
        tt.select_rows(scores, 513)
    with pytest.raises(ValueError, match="fp32 rows"):
        tt.select_rows(scores.half(), 64)
    with pytest.raises(ValueError, match="head_dim"):
        idx, p, sums, counts = tt.select_rows(scores, 64)
        tt.gather_pv(idx, p, sums, counts, v[0, :, :, :48], torch.empty(hkv, grp, t, 48))


def test_topk_kernels_match_the_reference_under_the_interpreter():
    run_under_interpreter("tests.test_triton_topk_interpret", "_check_topk")
