"""The pre-shuffled expert layout of `gluon_moe` (`kernels.moe_shuffle`), on CPU: it holds exactly the weights
of the pack's layout, and each thread's bytes are the A fragment wgmma's register layout gives it."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import moe_shuffle
from diffgemma.quant.weight import QuantWeight


def _weight(fmt: str, e: int = 2, r: int = 128, k: int = 192) -> QuantWeight:
    g = torch.Generator().manual_seed(0)
    return QuantWeight.quantize(torch.randn(e, r, k, generator=g).to(torch.bfloat16), fmt)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_shuffle_holds_the_weights(fmt):
    w = _weight(fmt)
    s = moe_shuffle.shuffle(w)
    assert torch.equal(moe_shuffle.unshuffle(s), w.dequantize())
    assert s.nbytes == w.nbytes  # a permutation: no byte added (int4's zero words hold the same nibbles)


def _fragment(warp: int, lane: int) -> list[tuple[int, int]]:
    """(row, input) of a thread's 32 A values of a 64 x 64 tile in register order, from PTX's wgmma register
    fragment for m64nNk16 (.bf16 A): per 16-input step a thread holds rows g, g + 8 (g = lane / 4 in its warp's
    16 rows) and inputs 2 (lane % 4) + {0, 1}, + 8, in the order (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1),
    (r, c + 8), ... ; the four steps follow one another."""
    out = []
    row, col = 16 * warp + lane // 4, 2 * (lane % 4)
    for step in range(4):
        for dk, dr in ((0, 0), (0, 8), (8, 0), (8, 8)):
            out += [(row + dr, 16 * step + col + dk + b) for b in (0, 1)]
    return out


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_a_thread_loads_its_wgmma_fragment(fmt):
    w = _weight(fmt, e=1, r=64, k=64)
    s = moe_shuffle.shuffle(w)
    dense = w.dequantize()[0]
    if fmt == "int4":
        # fragment value i of a thread: in its word i // 8 (a little-endian int32), the pair p = (i // 2) % 4 at
        # bits 4p (i even) and 16 + 4p (i odd): byte 4 (i // 8) + 2 (i % 2) + p // 2, nibble p % 2
        i = torch.arange(32)
        byte, shift = 4 * (i // 8) + 2 * (i % 2) + (i // 2) % 4 // 2, 4 * ((i // 2) % 2)
        nib = (s.data.reshape(4, 32, 16)[:, :, byte].long() >> shift) & 15  # (warp, lane, value)
        scale = s.scale.reshape(4, 8, 4).float()  # (warp, quad, 2 group + row half)
        words = s.zero.to(torch.int32).reshape(4, 8) & 0xFFFF
    else:
        vals = s.data.reshape(4, 32, 32).float()
    for warp in range(4):
        for lane in range(32):
            frag = _fragment(warp, lane)
            want = torch.stack([dense[r, k] for r, k in frag])
            if fmt == "fp8":
                got = vals[warp, lane] * torch.stack([w.parts["_scale"][0, r, 0] for r, _ in frag])
            else:
                got = []
                for i, (r, k) in enumerate(frag):
                    j = 2 * (k // 32) + (r // 8) % 2  # the thread's scale / zero of this value
                    z = (words[warp, lane // 4] >> (4 * j)) & 15
                    got.append((nib[warp, lane, i] - z).float() * scale[warp, lane // 4, j])
                got = torch.stack(got)
            assert torch.equal(got, want), (warp, lane)


def test_shuffle_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiples of 64"):
        moe_shuffle.shuffle(_weight("int4", r=96))
    with pytest.raises(ValueError, match="int4 or fp8"):
        moe_shuffle.shuffle(_weight("q8"))


def test_the_step_takes_gluon_for_int4_experts(monkeypatch):
    """`FastSteps.experts` hands an int4 layer's routed, sorted pairs to `gluon_moe.experts_sorted` with the
    shuffled copy (made once, kept on the weight); the kernel stands in here as the reference on the unshuffled
    weights, so what is pinned is the step's plumbing: perm, bounds, top-k and the sorted output's order. The
    batch-invariant mode and fp8 do not take it (tests/gpu/test_gluon_moe.py pins the kernel itself)."""
    from types import SimpleNamespace

    from diffgemma.kernels import dispatch
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.model.passes import DENOISE, Pass
    from diffgemma.model.steps import FastSteps, Routing

    calls = []

    def experts_sorted(x, sg, sd, perm, bounds, top_k):
        calls.append((sg, sd))
        gu, dn = moe_shuffle.unshuffle(sg), moe_shuffle.unshuffle(sd)
        return ref.experts_sorted(x.float(), perm, bounds, top_k, gu, dn)

    fake = SimpleNamespace(MAX_PAIRS_PER_EXPERT=32, experts_sorted=experts_sorted)
    monkeypatch.setattr(
        dispatch, "triton", lambda name, x=None, fits=True: fake if fits and name == "gluon_moe" else None
    )
    e, hidden, inter, n, k = 4, 128, 64, 16, 2
    g = torch.Generator().manual_seed(1)
    layers = {
        fmt: SimpleNamespace(
            experts_gate_up=QuantWeight.quantize(
                torch.randn(e, 2 * inter, hidden, generator=g).to(torch.bfloat16), fmt
            ),
            experts_down=QuantWeight.quantize(
                torch.randn(e, hidden, inter, generator=g).to(torch.bfloat16), fmt
            ),
        )
        for fmt in ("int4", "fp8")
    }
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(n, e, generator=g), -1).topk(k, dim=-1)
    bounds, perm, slot = ref.sort_pairs(ids, e)
    routing = Routing(w, ids, bounds, perm, slot)
    p = Pass(DENOISE, [], n, torch.arange(n), [0])
    layer = layers["int4"]
    got = FastSteps(compile=False).experts(x, routing, layer, p)
    gu, dn = layer.experts_gate_up.dequantize(), layer.experts_down.dequantize()
    assert torch.equal(got, ref.experts_sorted(x.float(), perm, bounds, k, gu, dn))
    assert calls == [(moe_shuffle.cached(layer.experts_gate_up), moe_shuffle.cached(layer.experts_down))]
    FastSteps(compile=False).experts(x, routing, layer, p)
    assert calls[1][0] is calls[0][0]  # the shuffled copy is kept
    FastSteps(compile=False, invariant=True).experts(x, routing, layer, p)
    FastSteps(compile=False).experts(x, routing, layers["fp8"], p)
    assert len(calls) == 2
