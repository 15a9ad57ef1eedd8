"""The Triton kernels run by Triton's CPU interpreter at small shapes: the MoE kernels (kernels/triton_moe.py)
against torch_ref in fp32 and the grouped-GEMM path in bf16, the rows' exp and sums (kernels/triton_softmax.py)
against torch.softmax, the router's top-k and sort (kernels/triton_route.py) against its spec, the Q/K/V norms
and RoPE (kernels/triton_qkv.py) against the eager region. Skipped without triton.

The interpreter has to be on before triton wraps any kernel in the process, so the check runs in a
subprocess with TRITON_INTERPRET=1: nothing leaks into this pytest process or its other tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_moe() -> None:
    """Runs in the subprocess. Expert 0 gets no pair, expert 1 one pair per row (40: several M-tiles and,
    with m_slots=2, several per slot), experts 2-5 the rest; x is a strided view."""
    from diffgemma.kernels import library
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_moe as tm

    assert tm._UPCAST_DOT, "the interpreter is not on"
    g = torch.Generator().manual_seed(0)
    n, k, e, h, i = 40, 3, 6, 64, 32
    x = torch.randn(n, h + 8, generator=g)[:, :h]
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    others = torch.stack([2 + torch.randperm(4, generator=g)[: k - 1] for _ in range(n)])
    ids = torch.cat([torch.ones(n, 1, dtype=torch.long), others], dim=1)
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1)

    configs = {
        "default": tm.CONFIGS[tm.DEFAULT_CONFIG],  # block_k 128 > H: the masked-K path
        "even_k_slots": tm.MoeConfig(
            tm.Tiles(block_n=16, block_k=32, m_slots=2), tm.Tiles(block_n=16, block_k=16, m_slots=2)
        ),
        "swap": tm.MoeConfig(tm.Tiles(block_n=16, swap_ab=True), tm.Tiles(block_k=16, swap_ab=True)),
        # weights through TMA descriptors: column blocks past I / H read the next rows (not stored), K past I
        # reads zeros
        "tma": tm.MoeConfig(
            tm.Tiles(block_n=64, block_k=32, m_slots=2, tma=True), tm.Tiles(block_n=128, block_k=64, tma=True)
        ),
        # the column blocks on the grid's fast axis, several of them and several M-slots an expert
        "cols_fast": tm.MoeConfig(
            tm.Tiles(block_n=16, block_k=32, m_slots=2, cols_fast=True),
            tm.Tiles(block_n=16, block_k=16, m_slots=2, cols_fast=True),
        ),
        # a prefill chunk's tiles: 128 pairs and 128 / 256 weight rows a tile, wider than this test's experts
        "prefill": tm.CONFIGS["prefill"],
    }
    assert tm.config_for(32 * e, e) is tm.CONFIGS[tm.DEFAULT_CONFIG]
    assert tm.config_for(32 * e, e, split3=True) is tm.CONFIGS[tm.SPLIT3_CONFIG]  # fewer stages: fp32 x tiles
    assert tm.config_for(32 * e + 1, e) is tm.CONFIGS["prefill"]
    want = ref.moe_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    for name, cfg in configs.items():
        got = tm.moe_experts_triton(x, weights, ids, gate_up, down, cfg)
        assert got.dtype == torch.float32 and got.shape == (n, h)
        assert _rel(got, want) < 1e-5, (name, _rel(got, want))

    # fp32 activations on bf16 experts (a short prompt's prefill): x cut into three bf16 parts, each product
    # exact; a part lost or cut wrong is off by 2^-9 or more relative
    w16 = [t.bfloat16() for t in (gate_up, down)]
    want16 = ref.moe_experts(x.double(), weights.double(), ids, w16[0].double(), w16[1].double())
    for name, cfg in configs.items():
        got = tm.moe_experts_triton(x, weights, ids, w16[0], w16[1], cfg)
        assert got.dtype == torch.float32
        assert _rel(got, want16) < 1e-5, (name, _rel(got, want16))

    # bf16: the interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), which biases
    # every rounding toward zero (rel 1.7e-2 here); this pins the bf16 plumbing (a wrong row, column or
    # weight gives rel ~1), not the rounding, which tests/gpu/test_triton_moe.py pins
    bf = [t.bfloat16() for t in (x, gate_up, down)]
    grouped = library.moe_experts_grouped(bf[0], weights, ids, bf[1], bf[2])
    for name, cfg in configs.items():
        got = tm.moe_experts_triton(bf[0], weights, ids, bf[1], bf[2], cfg)
        assert got.dtype == torch.bfloat16
        assert _rel(got, grouped) < 4e-2, (name, _rel(got, grouped))


def _check_softmax() -> None:
    """exp_rows: p / sums is the softmax (and p is 0 past a row's limit) for rows longer than one block and not a
    multiple of it, a wide range of scores, fp32 and bf16 out, causal limits and a device-side count of valid
    columns; divide_rows into o_proj's rows."""
    from diffgemma.kernels import library
    from diffgemma.kernels import triton_softmax as ts

    def check(x, causal=None, n_valid=None, dtype=torch.float32, tol=1e-6, tail=None):
        valid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32)
        cols = torch.arange(x.shape[-1])
        keep = cols[None, :] < (n_valid or x.shape[-1])
        if tail is not None:
            causal = (n_valid - tail + 1, tail)  # what the tail means: the last tail valid columns are causal
        if causal is not None:
            keep = keep & (cols[None, :] < causal[0] + torch.arange(x.shape[-2])[:, None] % causal[1])
        want = torch.softmax(x.double().masked_fill(~keep, float("-inf")), dim=-1)
        for exp in (ts.exp_rows, library.exp_to):  # the kernel, and the torch path on the CPU
            p, sums = exp(x, dtype, None if tail else causal, valid, tail)
            assert p.shape == x.shape and p.dtype == dtype and sums.shape == x.shape[:-1]
            assert bool(torch.isfinite(p).all()) and bool((p.masked_select(~keep.expand_as(p)) == 0).all())
            got = p.double() / sums.double()[..., None]
            assert bool(((got - want).abs() <= want * tol + 1e-12).all()), (x.shape, causal, n_valid, dtype)

    g = torch.Generator().manual_seed(0)
    for n_cols in (1, 700, ts.BLOCK, 2 * ts.BLOCK + 5):
        x = torch.randn(3, 2, n_cols, generator=g) * 8
        check(x)
        # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): within one bf16 ulp
        check(x, dtype=torch.bfloat16, tol=2**-7)
    # a row whose max lies past the first block by more than 64: exp(x - c) overflowed there, and the row is
    # written again from its max
    x = torch.randn(2, 3, 2 * ts.BLOCK + 5, generator=g) * 8
    x[1, 2, -10] = 300.0
    check(x)
    x[1, 2, ts.BLOCK + 3] = 400.0
    check(x, n_valid=ts.BLOCK + 9)
    # causal (base, period): row r keeps its first base + r % period columns (capped at the row), zeros after;
    # the causal blocks of a full-layer prefill chunk, limits on both sides of a block boundary
    for n_cols, base, period in ((700, 5, 3), (2 * ts.BLOCK + 5, ts.BLOCK - 1, 4), (40, 38, 5)):
        check(torch.randn(2, 2 * period, n_cols, generator=g) * 8, causal=(base, period))
    # a device-side count of valid columns (the denoise graph's keys), alone and under a causal limit
    for n_cols, n_valid, causal in (
        (700, 300, None),
        (2 * ts.BLOCK + 5, ts.BLOCK + 1, None),
        (40, 20, (15, 4)),
    ):
        check(torch.randn(2, 8, n_cols, generator=g) * 8, causal, n_valid)
    # a commit's causal tail: rows of 2 heads x 2 groups x 5 queries, the queries the last 5 valid columns;
    # one across a block boundary
    for n_cols, n_valid in ((40, 23), (2 * ts.BLOCK + 5, ts.BLOCK + 2)):
        check(torch.randn(2, 10, n_cols, generator=g) * 8, n_valid=n_valid, tail=5)
    # divide_rows into o_proj's rows: x [H, G*T, n] to [T, H, G, n], here G = 2 and T = 3
    y, sums = torch.randn(2, 6, 40, generator=g), torch.rand(2, 6, generator=g) + 0.5
    rows = torch.empty(3, 2, 2, 40)
    ts.divide_rows(y, sums, rows.permute(1, 2, 0, 3))
    want_rows = (y / sums[..., None]).view(2, 2, 3, 40).permute(2, 0, 1, 3)
    assert float((rows - want_rows).abs().max()) <= 1e-6 * float(rows.abs().max())
    with pytest.raises(ValueError, match="fp32 rows"):
        ts.exp_rows(torch.zeros(2, 4, dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="one int32"):
        ts.exp_rows(torch.zeros(2, 4), torch.float32, valid=torch.tensor([2]))
    with pytest.raises(ValueError, match="tail counts back"):
        ts.exp_rows(torch.zeros(2, 4), torch.float32, tail=2)
    with pytest.raises(ValueError, match="does not hold"):
        ts.divide_rows(y, sums, torch.empty(2, 2, 2, 40))


def check_route_sort(logits: torch.Tensor, pes: torch.Tensor, k: int) -> None:
    """`triton_route.route_sort` against its spec (also run by tests/gpu): the picked experts are a top-k of
    the softmax (ties at the k-th value resolved to the lowest ids, as torch.topk on CUDA does), the weights
    `torch_ref.route_weights`' for those experts, and perm/slot/bounds the stable sort of the flat ids."""
    from diffgemma.kernels import triton_route as tr

    n, e = logits.shape
    w, ids, bounds, perm, slot = tr.route_sort(logits, pes, k)
    ids = ids.long()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = torch.topk(probs, k, dim=-1).values
    assert bool((probs.gather(1, ids).sort(1, descending=True).values == top).all())  # a valid top-k
    assert bool((ids.sort(1).values.diff(dim=1) > 0).all())  # k distinct experts a row
    kth = top[:, -1:]
    above = (probs > kth).sum(1, keepdim=True)
    lowest_tied = (probs == kth).cumsum(1) <= k - above  # the tied columns a lowest-id tie-break keeps
    want_set = (probs > kth) | ((probs == kth) & lowest_tied)
    assert bool((torch.zeros_like(want_set).scatter(1, ids, True) == want_set).all())
    picked = probs.gather(1, ids)
    want_w = picked / picked.sum(1, keepdim=True) * pes[ids]
    assert float(((w - want_w).abs() / want_w).max()) < 1e-5
    sorted_ids, want_perm = torch.sort(ids.reshape(-1), stable=True)
    assert bool((perm == want_perm).all()) and bool(
        (slot[perm] == torch.arange(n * k, device=slot.device)).all()
    )
    experts = torch.arange(e + 1, device=ids.device)
    assert bool((bounds.long() == torch.searchsorted(sorted_ids, experts)).all())


def _check_route() -> None:
    """Rows of ties (bf16 logits tie often), a row all tied, E not a power of two, N not a multiple of the
    kernels' row block, more row blocks than the sort's block of them and more pairs than its pair block; row
    blocks of 4, 8, 16 and 32 (`triton_route.block_rows`)."""
    g = torch.Generator().manual_seed(0)
    for n, e, k in ((40, 6, 3), (70, 128, 8), (33, 12, 4), (600, 12, 4), (1500, 12, 4), (2100, 12, 2)):
        logits = (torch.randn(n, e, generator=g) * 2).bfloat16()
        logits[0] = 1.0
        check_route_sort(logits, torch.rand(e, generator=g) + 0.5, k)


def check_route_sort_from(x: torch.Tensor, proj: torch.Tensor, pes: torch.Tensor, k: int, tol: float) -> None:
    """`triton_route.route_sort_from` (also run by tests/gpu): its partial products sum (in split order) to
    x @ proj.T within `tol` of its magnitude, and it routes exactly as `route_sort` on that sum rounded to x's
    dtype (the same experts and order, the weights to fp32 rounding), which `check_route_sort` checks against
    the spec."""
    from diffgemma.kernels import triton_route as tr

    n, e = x.shape[0], proj.shape[0]
    parts = tr.router_partials(x, proj)
    assert parts.shape[1] == n and bool((parts[:, :, e:] == 0).all())
    acc = parts[0, :, :e].clone()
    for part in parts[1:]:
        acc += part[:, :e]
    want = x.double() @ proj.double().T
    assert float((acc.double() - want).abs().max() / want.abs().max()) < tol
    logits = acc.to(x.dtype)
    got, want = tr.route_sort_from(x, proj, pes, k), tr.route_sort(logits, pes, k)
    # the weights within fp32 rounding: the two kernels' softmax sums may reduce in other orders
    assert float(((got[0] - want[0]).abs() / want[0]).max()) < 1e-6
    for a, b in zip(got[1:], want[1:], strict=True):
        assert torch.equal(a, b)
    check_route_sort(logits, pes, k)


def _check_route_from() -> None:
    """H not a multiple of the router's column block (one split and several), E below tl.dot's 16 and not a
    power of two, N not a multiple of the row block. fp16: the interpreter's tl.dot multiplies bf16 operands
    as their raw bits (tests/gpu runs bf16)."""
    from diffgemma.kernels import triton_route as tr

    g = torch.Generator().manual_seed(1)
    for n, h, e, k, dtype in (
        (40, 300, 6, 3, torch.float16),
        (70, 1000, 128, 8, torch.float16),
        (33, 16, 12, 4, torch.float16),
    ):
        x = torch.randn(n, h, generator=g).to(dtype)
        proj = (torch.randn(e, h, generator=g) * h**-0.5).to(dtype)
        check_route_sort_from(x, proj, torch.rand(e, generator=g) + 0.5, k, 1e-5)
    with pytest.raises(ValueError, match="16-bit"):
        tr.router_partials(torch.zeros(4, 16), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="proj"):
        tr.router_partials(torch.zeros(4, 16).bfloat16(), torch.zeros(2, 8).bfloat16())


def check_norm_rope(dtype: torch.dtype, device: str, t: int, tol: float, min_exact: float = 0.0) -> None:
    """`triton_qkv.norm_rope` against the eager `regions.qkv_post` for both layer kinds (sliding: own V, default
    RoPE; full: V = raw K, proportional RoPE), into a new tensor and into a strided view (the cache's canvas
    slots). tol: max abs difference over the output's max abs; min_exact: the share of elements that must
    equal the eager ones bit for bit (also run by tests/gpu)."""
    from diffgemma.kernels import regions
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_qkv as tq

    g = torch.Generator(device=device).manual_seed(1)
    kinds = ((16, 4, 2, True, (1e4, "default", 1.0)), (32, 4, 1, False, (1e6, "proportional", 0.25)))
    if device == "cuda":
        kinds = ((256, 16, 8, True, (1e4, "default", 1.0)), (512, 16, 2, False, (1e6, "proportional", 0.25)))
    for hd, nq, nkv, has_v, rope in kinds:
        heads = nq + nkv * (2 if has_v else 1)
        qkv = torch.randn(t, heads * hd, generator=g, device=device).to(dtype) * 3
        qn, kn = (1 + 0.3 * torch.randn(hd, generator=g, device=device).to(dtype) for _ in range(2))
        inv = ref.rope_inv_freq(hd, *rope).to(device)
        pos = torch.arange(30000, 30000 + t, device=device)
        q3, k3 = qkv[:, : nq * hd].view(t, nq, hd), qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
        v3 = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd) if has_v else None
        want = regions.qkv_post(q3, k3, v3, qn, kn, inv, pos, 1e-6, True)
        cos, sin = ref.rope_cos_sin(inv, pos, dtype)
        cache = torch.zeros(2, nkv, t + 9, hd, device=device, dtype=dtype)
        for out in (None, cache[:, :, 4 : 4 + t]):
            got = tq.norm_rope(qkv, nq, nkv, has_v, cos, sin, qn, kn, 1e-6, out)
            assert out is None or got[1].data_ptr() == out.data_ptr()
            for a, b in zip(got, want, strict=True):
                assert (
                    a.shape == b.shape
                    and a.dtype == b.dtype
                    and a.is_contiguous() == (a is got[0] or out is None)
                )
                err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                assert err <= tol, (hd, err)
                exact = float((a == b).float().mean())
                assert exact >= min_exact, (hd, exact)
        assert float(cache[:, :, :4].abs().max()) == 0 and float(cache[:, :, 4 + t :].abs().max()) == 0
        # the slot read on the device: the whole buffer in, K/V at slots 6.. (a CUDA graph's, any cache length)
        cache.zero_()
        slot = torch.tensor([6], dtype=torch.int32, device=device)
        _, kv = tq.norm_rope(qkv, nq, nkv, has_v, cos, sin, qn, kn, 1e-6, cache[:, :, 1:], kv_slot=slot)
        assert kv.data_ptr() == cache[:, :, 1:].data_ptr()
        err = float(
            (cache[:, :, 7 : 7 + t].float() - want[1].float()).abs().max() / want[1].float().abs().max()
        )
        assert err <= tol, (hd, err)
        assert float(cache[:, :, :7].abs().max()) == 0 and float(cache[:, :, 7 + t :].abs().max()) == 0


def _check_qkv() -> None:
    # fp32: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), so the roundings are pinned on
    # the GPU (tests/gpu), the indexing here
    check_norm_rope(torch.float32, "cpu", 37, 1e-6)


def _check_combine() -> None:
    """`triton_combine.post_ffn` against the eager `regions.post_ffn`, with and without the next layer's norm; H
    not a power of two. fp16: the interpreter rounds it as the GPU does, so the roundings are compared too."""
    from diffgemma.kernels import regions
    from diffgemma.kernels import triton_combine as tc

    g = torch.Generator().manual_seed(5)
    n, k, hid = 16, 3, 700
    for dt, tol, min_exact in ((torch.float32, 1e-5, 0.0), (torch.float16, 2e-3, 0.995)):
        h, dense = (torch.randn(n, hid, generator=g) * 2).to(dt), torch.randn(n, hid, generator=g).to(dt)
        w = torch.rand(n, k, generator=g)
        perm = torch.randperm(n * k, generator=g)
        slot = torch.empty_like(perm)
        slot[perm] = torch.arange(n * k)
        norms = [(1 + 0.3 * torch.randn(hid, generator=g)).to(dt) for _ in range(3)]
        scalar = torch.tensor([0.7]).to(dt)
        y = torch.randn(n * k, hid, generator=g).to(dt)
        for w_next in (norms[2], None):
            args = (h, dense, y, slot, w, norms[0], norms[1], scalar, w_next, 1e-6)
            want, got = regions.post_ffn(*args), tc.post_ffn(*args)
            assert (got[1] is None) == (w_next is None)
            for a, b in zip(got, want, strict=True):
                if b is None:
                    continue
                assert a.dtype == b.dtype and a.shape == b.shape
                err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                assert err <= tol, (dt, err)
                exact = float((a == b).float().mean())  # a rounding skipped leaves ~20% unequal
                assert exact >= min_exact, (dt, exact)


def check_row_stats(logits: torch.Tensor, temp: float) -> None:
    """`triton_sampler.row_stats` against the sampler's torch ops (also run by tests/gpu): the same argmax, and
    probabilities, entropies and top probabilities within a few fp32 ulps; the sparse SC input equal to
    `sampler.sc_probs` but at columns within rounding of its floor; the SC input written into a given buffer,
    and without the dense probs when they are not asked for."""
    from diffgemma.engine import sampler as S
    from diffgemma.kernels import triton_sampler as ts

    floor = S.SC_SPARSE_LOG_RATIO
    probs, sc, entropy, argmax, p_max = ts.row_stats(logits, temp, floor)
    z = logits / temp
    logp = torch.log_softmax(z, dim=-1)
    want = logp.exp()
    assert torch.equal(argmax, want.max(-1).indices)
    assert torch.equal(p_max, probs.max(-1).values)
    torch.testing.assert_close(probs, want, rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(entropy, -(want * logp).sum(-1), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(p_max, want.max(-1).values, rtol=2e-5, atol=0)
    want_sc = S.sc_probs(want, True)
    kept, want_kept = sc > 0, want_sc > 0
    assert torch.equal(sc[kept], probs[kept]) and int(kept.sum()) > 0
    at_floor = (z - z.max(-1, keepdim=True).values - floor).abs() < 1e-4 * z.abs().amax(-1, keepdim=True)
    assert bool((at_floor | (kept == want_kept)).all())
    dense_sc = ts.row_stats(logits, temp)[1]
    assert torch.equal(dense_sc, probs)  # not sparse: sc is the probs
    out = torch.full_like(logits, float("nan"))
    no_probs, sc2, *_ = ts.row_stats(logits, temp, floor, need_probs=False, sc_out=out)
    assert no_probs is None and sc2 is out and torch.equal(out, sc)
    # into a bf16 buffer (a denoise graph's input), sparse and dense alike: the fp32 values rounded, within a bf16
    # ulp. On the H200 the compiled bf16 variant's p rounded to the other side of a midpoint in 7 of 67M elements
    # of a real-shape step (docs/performance.md, "Sampler row pass"); Triton 3.6's interpreter truncates.
    for lf, want_p, want_sc in ((floor, None, sc), (None, probs, probs)):
        out = torch.full_like(logits, float("nan"), dtype=torch.bfloat16)
        got_p, sc3, *_ = ts.row_stats(logits, temp, lf, need_probs=want_p is not None, sc_out=out)
        assert sc3 is out
        ulps = (out.view(torch.int16).int() - want_sc.to(torch.bfloat16).view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1
        if logits.is_cuda:
            assert float((ulps == 0).float().mean()) >= 0.9999
        if want_p is None:
            assert got_p is None
        else:  # another compiled variant: p within fp32 ulps of the first call's, as of torch's above
            torch.testing.assert_close(got_p, want_p, rtol=2e-5, atol=1e-12)
    if not (logits.is_cuda and S.triton_rows(logits)):
        return
    stats = S.row_stats(logits, temp, sc_sparse=True)  # the sampler's dispatch takes the kernel
    assert (
        torch.equal(stats.probs, probs) and torch.equal(stats.sc, sc) and torch.equal(stats.entropy, entropy)
    )


def check_row_stats_softcap(raw: torch.Tensor, temp: float) -> None:
    """The row pass on logits before the final softcap (`softcap=`, as generation passes a denoise graph's bf16
    buffer) against the row pass on `torch_ref.softcap` of them: the same argmax, and the rest within fp32 ulps
    (tanh may differ by an ulp between the two), the SC input into a bf16 buffer within one bf16 ulp."""
    from diffgemma.engine import sampler as S
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_sampler as ts

    cap, floor = 30.0, S.SC_SPARSE_LOG_RATIO
    probs, sc, entropy, argmax, p_max = ts.row_stats(raw, temp, floor, softcap=cap)
    w_probs, w_sc, w_entropy, w_argmax, w_p_max = ts.row_stats(ref.softcap(raw, cap), temp, floor)
    assert torch.equal(argmax, w_argmax)
    torch.testing.assert_close(probs, w_probs, rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(entropy, w_entropy, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(p_max, w_p_max, rtol=2e-5, atol=0)
    assert int(((sc > 0) != (w_sc > 0)).sum()) <= raw.shape[0]  # at most a column at the floor a row
    out = torch.full_like(raw, float("nan"), dtype=torch.bfloat16)
    ts.row_stats(raw, temp, floor, need_probs=False, sc_out=out, softcap=cap)
    both = (out.float() > 0) & (w_sc > 0)
    ulps = (out[both].view(torch.int16).int() - w_sc[both].to(torch.bfloat16).view(torch.int16).int()).abs()
    assert int(both.sum()) > 0 and int(ulps.max()) <= 1
    dispatched = raw.is_cuda and S.triton_rows(raw, softcapped_here=True)
    if dispatched:  # the sampler's dispatch takes the kernel
        stats = S.row_stats(raw, temp, sc_sparse=True, softcap=cap)
        assert torch.equal(stats.probs, probs) and torch.equal(stats.entropy, entropy)


def _check_sampler() -> None:
    """Rows longer than one block and not a multiple of it, a row whose maximum is tied (the first column wins),
    a flat row (entropy log V), a peaked row (entropy ~0) and temperatures below and above 1."""
    from diffgemma.kernels import triton_sampler as ts

    g = torch.Generator().manual_seed(0)
    for v, temp in ((2 * ts.BLOCK + 37, 0.7), (ts.BLOCK // 2, 1.3)):
        logits = torch.randn(5, v, generator=g) * 4
        logits[1, [3, v - 2, v // 2]] = 40.0
        logits[2] = 0.25
        logits[3, v - 1] = 200.0
        check_row_stats(logits, temp)
        check_row_stats_softcap((logits * 3).to(torch.bfloat16), temp)
    # rows cut into 8 chunks of 16 columns (a program each; the last three empty) against one program a row
    logits = torch.randn(3, 65, generator=g) * 4
    logits[1, [7, 50]] = 30.0  # a tie across chunks: the first column wins
    one = ts.row_stats(logits, 0.9, -10.0, chunks=1)
    many = ts.row_stats(logits, 0.9, -10.0, chunks=8, block=8)
    assert torch.equal(many[3], one[3]) and int(many[3][1]) == 7
    for a, b in zip(many, one, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-12)


@pytest.mark.parametrize(
    "check",
    [
        "_check_moe",
        "_check_softmax",
        "_check_route",
        "_check_route_from",
        "_check_qkv",
        "_check_combine",
        "_check_sampler",
    ],
)
def test_triton_kernels_under_interpreter(check: str):
    run_under_interpreter("tests.test_triton_interpret", check)


def run_under_interpreter(module: str, check: str) -> None:
    """Call module.check() in a subprocess with TRITON_INTERPRET=1; fail with its output if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from {module} import {check}; {check}()"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
