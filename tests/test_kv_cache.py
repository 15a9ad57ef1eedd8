"""KV cache: ring and linear layouts, truncate/rewind byte-consistency, fingerprint."""

from __future__ import annotations

import pytest
import torch

from diffgemma.runner.runner import ModelRunner
from diffgemma.weights.loader import load_model


@torch.no_grad()
def test_rewind_and_regenerate_restores_kv_bytes_across_the_ring_wrap(tiny_a):
    runner = ModelRunner(load_model(tiny_a, "cpu", torch.float32))  # the reference kernels' aligned prefill
    kv = runner.new_cache(512, ring_size=32)  # window 8, period 48: a ring that wraps twice below
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 1000, (1, 100), generator=g)
    b = torch.randint(0, 1000, (1, 12), generator=g)
    runner.prefill(a, kv)
    before = kv.fingerprint()
    runner.prefill(b, kv)
    after = kv.fingerprint()
    assert after != before
    runner.rewind(kv, 100)
    assert kv.fingerprint() == before  # rewinding restores the live KV exactly
    runner.prefill(b, kv)
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


def _pos_kv(cfg, layer: int, start: int, t: int, salt: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [1, h, t, d] whose every element names its position (and the write, by `salt`)."""
    h, d = cfg.num_kv_heads[layer], cfg.head_dims[layer]
    pos = torch.arange(start, start + t, dtype=torch.float32)[None, None, :, None] + salt
    k = pos.expand(1, h, t, d) + torch.arange(d) / 1000
    return k, -k


@pytest.mark.parametrize("max_tokens,ring_size", [(200, 10), (200, 40), (60, 60)])
def test_ring_read_and_read_with_across_wraps_and_rewinds(tiny_a, max_tokens, ring_size):
    """Writes of every size (a chunk longer than the ring too) and rewinds, checked position by position:
    `read` gives the window in position order, `read_with` that window then the canvas as views of the cache
    (no copy of the past), and storing the canvas there changes nothing that a later read sees."""
    from diffgemma.config import ModelConfig
    from diffgemma.model.kv_cache import KVCache, cache_bytes

    cfg = ModelConfig.from_dir(tiny_a)  # window 8, canvas 16, sliding and full layers
    kv = KVCache(cfg, max_tokens, "cpu", torch.float32, ring_size=ring_size)
    assert kv.nbytes() == cache_bytes(cfg, max_tokens, torch.float32, ring_size)
    c = cfg.canvas_length
    salt = {}  # position -> the salt of the write that holds it

    def want(i: int, end: int) -> torch.Tensor:
        lo = max(0, end - (cfg.sliding_window - 1)) if cfg.is_sliding(i) else 0
        held = [_pos_kv(cfg, i, p, 1, salt[p])[0] for p in range(lo, end)]
        return torch.cat([_pos_kv(cfg, i, 0, 0, 0.0)[0], *held], dim=2)

    def check():
        for i in range(cfg.num_layers):
            want_k = want(i, kv.length)
            k, v, pos = kv.read(i)
            assert torch.equal(pos, torch.arange(kv.length - k.shape[2], kv.length))
            assert torch.equal(k, want_k) and torch.equal(v, -want_k)
            for n in (c, c // 2, c + 3):  # the canvas's room, less, and more (concatenated instead)
                ck, cv = _pos_kv(cfg, i, 10_000, n, 0.5)
                keys, vals = kv.read_with(i, ck, cv)
                assert torch.equal(keys, torch.cat([want_k, ck], 2))
                assert torch.equal(vals, torch.cat([-want_k, cv], 2))
                base = kv.kv[i].untyped_storage().data_ptr()
                assert (keys.untyped_storage().data_ptr() == base) == (n <= c)
                if (
                    n <= c
                ):  # the same slots as the fused denoise reads them from the device (`denoise_geometry`)
                    length, first, count, canvas_slot, full_count = kv.denoise_geometry(n)
                    assert length == kv.length and full_count == kv.length + n
                    if cfg.is_sliding(i):
                        assert count <= kv.denoise_key_slots(n) and canvas_slot == first + count - n
                        assert torch.equal(kv.kv[i][0:1, :, first : first + count], keys)
                    else:
                        assert torch.equal(kv.kv[i][0:1, :, :full_count], keys)
        assert kv.fingerprint() == fp[kv.length]
        for end in range(kv.length + 1):  # every window a rewind may still reach, after the canvases
            if kv.can_truncate(end):
                assert all(torch.equal(kv.read(i, end)[0], want(i, end)) for i in range(cfg.num_layers))

    fp = {}
    sizes = [3, 7, 1, 30, 12, 2, 9, 25, 4]  # 30 > 10 slots, 25 > window: a chunk overwrites its own start
    s = 0.0
    for t in sizes:
        if kv.length + t > max_tokens:
            break
        s += 1
        for i in range(cfg.num_layers):
            kv.write(i, kv.length, torch.cat(_pos_kv(cfg, i, kv.length, t, s)))
        salt.update(dict.fromkeys(range(kv.length, kv.length + t), s))
        kv.length += t
        fp[kv.length] = kv.fingerprint()
        check()
        back = kv.length - 3
        if kv.can_truncate(back):  # rewind, check, then re-extend with other values
            kv.truncate(back)
            fp[back] = kv.fingerprint()
            check()
            s += 1
            for i in range(cfg.num_layers):
                kv.write(i, back, torch.cat(_pos_kv(cfg, i, back, 3, s)))
            salt.update(dict.fromkeys(range(back, back + 3), s))
            kv.length = back + 3
            fp[kv.length] = kv.fingerprint()
            check()


def test_kv_layout_names_each_kind_of_layer_and_adds_up_to_the_cache(tiny_a):
    import re

    from diffgemma.model.kv_cache import cache_bytes, kv_layout

    model = load_model(tiny_a, "cpu", torch.float32)
    cfg = model.cfg
    kv = model.new_cache(512, ring_size=32)
    line = kv_layout(cfg, 512, torch.float32, 32)
    allocated = sum(buf.numel() * buf.element_size() for buf in kv.kv)
    assert cache_bytes(cfg, 512, torch.float32, 32) == allocated
    counts = [int(n) for n in re.findall(r"(\d+) (?:full|sliding) layers", line)]
    assert sum(counts) == cfg.num_layers and "full layers" in line and "sliding layers" in line
    assert f"{cfg.canvas_length + 512:,}" in line  # a full layer's slots: the context and a canvas
