"""The fused prefill (torch.compile'd regions with a symbolic token count, compiled here for the CPU) pinned to
the unfused fast path, and the materialized-scores full-layer prefill attention pinned to the reference."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import cuda as fast
from diffgemma.kernels import torch_ref as ref
from diffgemma.weights.loader import load_model


@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize("block", [None, 7, 16, 64])
def test_attention_causal_scores_matches_reference(past, block):
    g = torch.Generator().manual_seed(past)
    h, hkv, t, d = 8, 2, 50, 16
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, past + t, d, generator=g)
    v = torch.randn(1, hkv, past + t, d, generator=g)
    qpos, kpos = torch.arange(past, past + t), torch.arange(past + t)
    want = ref.rows(ref.attention(q, k, v, kpos[None] <= qpos[:, None]))
    got = fast.attention_causal_scores(q, k, v, block=block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 all through: rounding only
    # the two-kernel path of attention_causal_past (CPU, or d <= 256), merged by log-sum-exp
    torch.testing.assert_close(fast.attention_causal_past(q, k, v), want, rtol=1e-5, atol=1e-5)
    # bf16: P rounded to bf16 before P @ V, as flash kernels do; ~3 significant digits
    got16 = fast.attention_causal_scores(q.bfloat16(), k.bfloat16(), v.bfloat16(), block=block)
    assert got16.dtype == torch.bfloat16
    assert float((got16.float() - want).norm() / want.norm()) < 1e-2


def _kv_state(kv) -> list[torch.Tensor]:
    return [t for i in range(kv.cfg.num_layers) for t in kv.read(i)[:2]]


@torch.no_grad()
def test_fused_prefill_matches_unfused_and_compiles_once_for_all_lengths(tiny_a):
    # fp32: the regions are the same ops as the unfused fast path; compiled, only the order of fp32 reductions
    # (and fused multiply-adds) differs, ~1e-7 relative per op, a few 1e-6 after 5 layers (measured 7e-6 max
    # abs on K/V of unit scale). 1e-4 leaves room and still catches any real difference (a wrong norm, scalar,
    # mask or position is O(1)).
    plain = load_model(tiny_a, "cpu", torch.float32)
    fused = load_model(tiny_a, "cpu", torch.float32)
    plain.fast, plain.fuse = True, False
    fused.fast, fused.fuse = True, True
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, plain.cfg.vocab_size, (1, 43), generator=g)
    canvas = torch.randint(0, plain.cfg.vocab_size, (1, plain.cfg.canvas_length), generator=g)
    kv_plain, kv_fused = plain.new_cache(128, ring_size=24), fused.new_cache(128, ring_size=24)

    # two chunks of different lengths (23, then 20): past keys in the second, the ring wraps (window 8); the
    # second longer than the canvas (16), which a commit's path would take (test_commit_matches_reference)
    plain.prefill(prompt[:, :23], kv_plain)
    fused.prefill(prompt[:, :23], kv_fused)
    assert list(fused._prefill_graphs) == [256]  # into an empty cache: padded to 256 (eager on the CPU)
    regions = fused.prefill_regions
    variants = {name: len(r._seen) for name, r in regions.items()}
    assert all(variants.values()), variants  # every prefill region was called (compiled)
    assert not any(r._seen for r in fused.fused_regions.values())  # not the denoise's fixed-shape set
    # A chunk of a new length must reuse the compiled regions: a recompile raises, which `Fused` turns into
    # `failed` (and eager).
    with torch._dynamo.config.patch(error_on_recompile=True):
        plain.prefill(prompt[:, 23:], kv_plain)
        fused.prefill(prompt[:, 23:], kv_fused)
    assert not any(r.failed for r in regions.values()), {n: r.failed for n, r in regions.items()}
    assert {name: len(r._seen) for name, r in regions.items()} == variants

    assert kv_fused.length == kv_plain.length == 43
    for got, want in zip(_kv_state(kv_fused), _kv_state(kv_plain), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the denoise that follows, on the same (unfused) path for both: only the caches differ
    fused.fuse = False
    torch.testing.assert_close(
        fused.denoise(canvas, kv_fused), plain.denoise(canvas, kv_plain), rtol=1e-4, atol=1e-4
    )


@torch.no_grad()
def test_fast_prefill_matches_reference_across_ring_wraps_and_rewinds(tiny_a):
    # The fast prefill attention (sliding layers: blocks of queries over one [window | chunk] buffer, the
    # window read from the ring; full layers: the cache's own view after the write) against the reference
    # path (the cache read in position order, masks from positions, torch_ref attention), fp32: the K/V it
    # leaves in every layer and the denoise after it. Chunks shorter and longer than the window (8) and the
    # ring (12 slots), a window that sees 0, some, or window - 1 cached positions, and rewinds.
    ref = load_model(tiny_a, "cpu", torch.float32)
    fast_m = load_model(tiny_a, "cpu", torch.float32)
    ref.fast, fast_m.fast, fast_m.fuse = False, True, False
    kv_ref, kv_fast = ref.new_cache(256, ring_size=12), fast_m.new_cache(256, ring_size=12)
    g = torch.Generator().manual_seed(4)
    canvas = torch.randint(0, ref.cfg.vocab_size, (1, ref.cfg.canvas_length), generator=g)
    for t, chunk in ((3, 4096), (20, 7), (9, 4096), (31, 4096), (2, 4096), (14, 5)):
        ids = torch.randint(3, 1000, (1, t), generator=g)
        ref.prefill(ids, kv_ref, chunk=chunk)
        fast_m.prefill(ids, kv_fast, chunk=chunk)
        assert kv_fast.length == kv_ref.length
        for got, want in zip(_kv_state(kv_fast), _kv_state(kv_ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        fast_m.fast = False  # the same (reference) denoise on both caches
        torch.testing.assert_close(
            fast_m.denoise(canvas, kv_fast), ref.denoise(canvas, kv_ref), rtol=1e-4, atol=1e-4
        )
        fast_m.fast = True
        if kv_ref.can_truncate(kv_ref.length - 3):
            kv_ref.truncate(kv_ref.length - 3)
            kv_fast.truncate(kv_fast.length - 3)


@torch.no_grad()
@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_commit_matches_reference(name, request):
    # A block's commit (up to the canvas's length, after a non-empty cache) runs the fused denoise layers over
    # the canvas slots, causal and padded to the canvas (`DiffusionGemma._commit`; graphed on CUDA, eager here),
    # against the reference prefill, fp32: the K/V every layer keeps, through ring wraps, rewinds and commits
    # shorter than the canvas, and the denoise after each.
    ckpt = request.getfixturevalue(name)
    ref_m, m = load_model(ckpt, "cpu", torch.float32), load_model(ckpt, "cpu", torch.float32)
    ref_m.fast, m.fast, m.fuse = False, True, True
    for model in (ref_m, m):  # equal in the checkpoints: made to differ, so that the encoder's must be used
        for layer in model.layers:
            layer.encoder_layer_scalar.data.mul_(1.5)
    c = m.cfg.canvas_length
    kv_ref, kv = ref_m.new_cache(256, ring_size=12), m.new_cache(256, ring_size=12)
    g = torch.Generator().manual_seed(5)
    canvas = torch.randint(0, m.cfg.vocab_size, (1, c), generator=g)
    prompt = torch.randint(3, 1000, (1, 9), generator=g)
    ref_m.prefill(prompt, kv_ref)
    m.prefill(prompt, kv)  # into an empty cache: the padded prefill, on the prefill regions
    seen = {n: len(r._seen) for n, r in m.prefill_regions.items()}
    for t in (c, 3, c, 7, 1, c - 1, c):
        ids = torch.randint(3, 1000, (1, t), generator=g)
        ref_m.prefill(ids, kv_ref)
        m.prefill(ids, kv)
        assert kv.length == kv_ref.length
        for got, want in zip(_kv_state(kv), _kv_state(kv_ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        m.fast = False  # the same (reference) denoise on both caches
        torch.testing.assert_close(m.denoise(canvas, kv), ref_m.denoise(canvas, kv_ref), rtol=1e-4, atol=1e-4)
        m.fast = True
        if t == 7:
            kv_ref.truncate(kv_ref.length - 2)
            kv.truncate(kv.length - 2)
    # the commits ran on the denoise's fixed-shape regions, not the prefill's
    assert {n: len(r._seen) for n, r in m.prefill_regions.items()} == seen
    assert all(r._seen for n, r in m.fused_regions.items() if n not in ("softcap", "route", "gelu_mul")), {
        n: len(r._seen) for n, r in m.fused_regions.items()
    }


@torch.no_grad()
def test_fused_prefill_only_in_the_model_dtype(tiny_a):
    # an fp32 compute dtype on a bf16 model (short prompts) takes the unfused path: the regions are compiled
    # for the model dtype
    m = load_model(tiny_a, "cpu", torch.bfloat16)
    m.fast, m.fuse = True, True
    m.prefill(torch.arange(3, 20)[None], m.new_cache(64), compute_dtype=torch.float32)
    assert not any(r._seen for r in m.prefill_regions.values())


@pytest.mark.parametrize("past", [0, 5, 7])
@pytest.mark.parametrize("block", [3, 8, 32])
def test_attention_window_matches_reference(past, block):
    # blocks of queries in one call, each over a strided view of one key buffer (ragged: 21 is no multiple of
    # 3, 8 or 32), GQA folded into the rows (4 query heads on 2 KV heads); the window (8) sees `past` cached
    # positions: 0 and 5 leave slots without a position (masked per block), 7 = window - 1 shares one mask
    g = torch.Generator().manual_seed(past)
    h, hkv, t, d, w = 4, 2, 21, 16, 8
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, past + t, d, generator=g)
    v = torch.randn(1, hkv, past + t, d, generator=g)
    qpos, kpos = torch.arange(100, 100 + t), torch.arange(100 - past, 100 + t)
    want = ref.attention(q, k, v, (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - w))
    kv = torch.cat([k, v])  # [2, hkv, past + t, d]
    bias = fast.window_bias(past, t, w, h // hkv, q.dtype, "cpu", block)
    assert bias.shape[0] == (1 if past == w - 1 else -(-t // block))
    got = fast.attention_window(q, kv[:, :, :past], kv[:, :, past:], bias)
    torch.testing.assert_close(got, ref.rows(want), rtol=1e-5, atol=1e-5)


def test_post_ffn_combines_the_expert_outputs_of_each_row():
    # eager post_ffn against the plain sum: the experts' output in expert-sorted order, gathered back by each
    # pair's sorted position and weighted
    from diffgemma.kernels import fused

    g = torch.Generator().manual_seed(3)
    n, k, hid = 50, 3, 64
    h, dense = torch.randn(n, hid, generator=g), torch.randn(n, hid, generator=g)
    outs, w = torch.randn(n * k, hid, generator=g), torch.rand(n, k, generator=g)
    w2, w1, scalar = torch.rand(hid, generator=g) + 0.5, torch.rand(hid, generator=g) + 0.5, torch.tensor(0.7)
    perm = torch.randperm(n * k, generator=g)  # sorted position s holds pair perm[s]
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(n * k)
    got, _ = fused.post_ffn(h, dense, outs[perm], slot, w, w2, w1, scalar, None, 1e-6)
    moe = (outs.view(n, k, hid) * w[:, :, None]).sum(1)
    want = (h + ref.rms_norm(dense + ref.rms_norm(moe, w2, 1e-6), w1, 1e-6)) * scalar
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
