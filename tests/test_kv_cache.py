"""KV cache: ring and linear layouts, truncate/rewind byte-consistency, fingerprint."""

from __future__ import annotations

import pytest
import torch

from diffgemma.weights.loader import load_model


@torch.no_grad()
def test_rewind_and_regenerate_restores_kv_bytes_across_the_ring_wrap(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    kv = model.new_cache(512, ring_size=24)  # window 8: a ring that wraps several times below
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 1000, (1, 40), generator=g)
    b = torch.randint(0, 1000, (1, 12), generator=g)
    model.prefill(a, kv)
    before = kv.fingerprint()
    model.prefill(b, kv)
    after = kv.fingerprint()
    assert after != before
    kv.truncate(40)
    assert kv.fingerprint() == before  # rewinding restores the live KV exactly
    model.prefill(b, kv)
    assert kv.fingerprint() == after  # and re-extending reproduces it bit for bit


@torch.no_grad()
def test_truncate_refuses_past_the_ring(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    kv = model.new_cache(512, ring_size=10)
    model.prefill(torch.arange(3, 43)[None], kv)
    assert kv.can_truncate(39) and not kv.can_truncate(20)
    with pytest.raises(ValueError, match="re-prefill"):
        kv.truncate(20)
    with pytest.raises(ValueError, match="cannot truncate to 50"):
        kv.truncate(50)
    assert kv.length == 40


@torch.no_grad()
def test_denoise_reads_but_never_writes_the_cache(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    kv = model.new_cache(128)
    model.prefill(torch.arange(3, 30)[None], kv)
    fp = kv.fingerprint()
    model.denoise(torch.arange(5, 21)[None], kv, sc_seed=True)
    assert kv.fingerprint() == fp and kv.length == 27


def test_cache_full_and_bad_ids_are_errors(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    kv = model.new_cache(16)
    with pytest.raises(ValueError, match="does not fit"):
        model.prefill(torch.arange(3, 30)[None], kv)
    with pytest.raises(ValueError, match="token ids must lie"):
        model.prefill(torch.tensor([[5, 99999]]), kv)
    assert kv.length == 0
