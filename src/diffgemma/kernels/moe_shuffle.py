"""Expert weights (int4, fp8 `QuantWeight`s [E, R, K]) shuffled once, in memory, into the order `gluon_moe`'s
kernels read: a thread's 128-bit load holds exactly the values of its wgmma A fragment (Marlin's idea). The pack
on disk keeps `formats`' layout; this is an in-memory copy made at load time, so a pack written before it loads
as it did.

Tiles of 64 rows x 64 inputs, stored tile after tile in (expert, row block, input block) order, each one a
contiguous run: int4 2048 bytes, fp8 4096. Inside a tile, with row n = 16 w + 8 a + q and input
k = 32 c + 16 d + 8 f + 2 l + b (w, l < 4; q < 8; a, b, c, d, f < 2), thread 4q + l of warp w holds
  int4: bytes 512 w + 16 (4q + l) + (8c + 4d + 2b + f), the value of row half a in the low (0) or high (1)
    nibble: each 32-bit word (c, d) holds its four bf16x2 pairs (a, f), the pair (b = 0, 1) at bits 4p and
    16 + 4p for p = a + 2f, so that a mask and a shift make one pair (`gluon_moe._INT4_WORD`);
  fp8: bytes 1024 w + 32 (4q + l) + (16c + 8d + 4f + 2a + b).
int4's scales (bf16), 128 a tile: 32 w + 4 q + 2 c + a (row n's scale of group c); its zero points, 32 16-bit
words a tile, word 8 w + q holding group c of row 16 w + 8 a + q in bits 4 (2c + a)... (the same four values).
fp8's one fp32 scale a row stays as it is ([E, R, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffgemma.quant.weight import QuantWeight

TILE = 64


@dataclass(frozen=True)
class Shuffled:
    """A quantized expert weight [E, R, K] in the kernels' tile order (`shuffle`)."""

    fmt: str
    shape: tuple[int, int, int]
    data: torch.Tensor  # int4: uint8 [E, R/64, K/64, 2048]; fp8: float8_e4m3fn [E, R/64, K/64, 4096]
    scale: torch.Tensor  # int4: bf16 [E, R/64, K/64, 128]; fp8: fp32 [E, R, 1]
    zero: torch.Tensor | None  # int4: int16 [E, R/64, K/64, 32]; fp8: None

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale) + ((self.zero,) if self.zero is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[E, R, K] -> [E, R/64, K/64, 64, 64]."""
    e, r, k = t.shape
    return t.reshape(e, r // TILE, TILE, k // TILE, TILE).permute(0, 1, 3, 2, 4)


def _unpack(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def shuffle(w: QuantWeight) -> Shuffled:
    """w (int4 or fp8, [E, R, K] with R and K multiples of 64) in the kernels' order."""
    if w.fmt not in ("int4", "fp8") or len(w.shape) != 3:
        raise ValueError(f"moe_shuffle takes int4 or fp8 expert weights [E, R, K], got {w.fmt} {w.shape}")
    e, r, k = w.shape
    if r % TILE or k % TILE:
        raise ValueError(f"moe_shuffle needs rows and inputs multiples of {TILE}, got {w.shape}")
    rb, kb = r // TILE, k // TILE
    if w.fmt == "fp8":
        v = _tiles(w.parts[""].view(torch.uint8)).reshape(e, rb, kb, 4, 2, 8, 2, 2, 2, 4, 2)
        # (w, a, q, c, d, f, l, b) -> (w, q, l, c, d, f, a, b)
        v = v.permute(0, 1, 2, 3, 5, 9, 6, 7, 8, 4, 10).reshape(e, rb, kb, 4096)
        scale = w.parts["_scale"].float().contiguous()
        return Shuffled("fp8", (e, r, k), v.contiguous().view(torch.float8_e4m3fn), scale, None)
    q = _tiles(_unpack(w.parts[""])).reshape(e, rb, kb, 4, 2, 8, 2, 2, 2, 4, 2)
    q = q.permute(0, 1, 2, 3, 5, 9, 6, 7, 10, 8, 4)  # (w, a, q, c, d, f, l, b) -> (w, q, l, c, d, b, f, a)
    data = (q[..., 0] | (q[..., 1] << 4)).reshape(e, rb, kb, 2048).contiguous()
    g = k // 32
    # groups: [E, R, G] -> (rb, kb, w, q, c, a) with row 16 w + 8 a + q, group 2 kb + c
    s = w.parts["_scale"].reshape(e, rb, 4, 2, 8, kb, 2).permute(0, 1, 5, 2, 4, 6, 3)
    z = _unpack(w.parts["_zero"])[..., :g].to(torch.int32)
    z = z.reshape(e, rb, 4, 2, 8, kb, 2).permute(0, 1, 5, 2, 4, 6, 3).reshape(e, rb, kb, 32, 4)
    words = (z << (4 * torch.arange(4, device=z.device, dtype=torch.int32))).sum(-1)
    words = torch.where(words >= 2**15, words - 2**16, words).to(torch.int16)
    return Shuffled("int4", (e, r, k), data, s.reshape(e, rb, kb, 128).contiguous(), words.contiguous())


def cached(w: QuantWeight) -> Shuffled | None:
    """`shuffle(w)`, made on the first call and kept on w (a second copy of the experts in memory: the prefill
    path reads the pack's layout). None while a CUDA graph is being captured and the copy is not made yet: the
    shuffle must not be recorded into the graph."""
    got = getattr(w, "_shuffled", None)
    if got is None:
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        got = shuffle(w)
        w._shuffled = got  # noqa: SLF001 - a cache on the weight object, not one of its parts
    return got


def unshuffle(s: Shuffled) -> torch.Tensor:
    """The float weight [E, R, K] (fp32) that `s` holds, decoded from the shuffled order (the tests' check)."""
    e, r, k = s.shape
    rb, kb = r // TILE, k // TILE
    if s.fmt == "fp8":
        v = s.data.view(torch.uint8).reshape(e, rb, kb, 4, 8, 4, 2, 2, 2, 2, 2)
        # (w, q, l, c, d, f, a, b) -> (w, a, q, c, d, f, l, b)
        v = v.permute(0, 1, 2, 3, 9, 4, 6, 7, 8, 5, 10).reshape(e, rb, kb, TILE, TILE)
        v = v.permute(0, 1, 3, 2, 4).reshape(e, r, k).view(torch.float8_e4m3fn)
        return v.float() * s.scale
    q = _unpack(s.data).reshape(e, rb, kb, 4, 8, 4, 2, 2, 2, 2, 2)
    # (w, q, l, c, d, b, f, a) -> (w, a, q, c, d, f, l, b)
    q = q.permute(0, 1, 2, 3, 10, 4, 6, 7, 9, 5, 8).reshape(e, rb, kb, TILE, TILE)
    q = q.permute(0, 1, 3, 2, 4).reshape(e, r, k).float()
    words = s.zero.to(torch.int32) & 0xFFFF
    z = (words[..., None] >> (4 * torch.arange(4, device=words.device, dtype=torch.int32))) & 15
    # (rb, kb, w, q, c, a) -> [E, R, G]
    z = z.reshape(e, rb, kb, 4, 8, 2, 2).permute(0, 1, 3, 6, 4, 2, 5).reshape(e, r, k // 32).float()
    sc = s.scale.reshape(e, rb, kb, 4, 8, 2, 2).permute(0, 1, 3, 6, 4, 2, 5).reshape(e, r, k // 32).float()
    return ((q.unflatten(-1, (-1, 32)) - z[..., None]) * sc[..., None]).flatten(-2)
