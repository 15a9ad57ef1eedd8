"""The seed's canvas RNG: a 64-bit LCG, vectorised by jump-ahead so a whole canvas is drawn at once.

state <- state * 6966169279 + 1039523323 (mod 2^64); a draw is the high 32 bits of the new state;
Rng(seed) starts at state = seed + 1. A token id is floor(u32 * vocab / 2^32), exact in integers, so every
device gets the same canvas.
"""

from __future__ import annotations

import numpy as np

MUL = 6966169279
INC = 1039523323
MASK = (1 << 64) - 1
# Per-block and per-retry seed offsets (odd 64-bit constants) so blocks and re-rolls draw fresh noise.
BLOCK_STRIDE = 0x9E3779B97F4A7C15
RETRY_STRIDE = 0xD1B54A32D192ED03


def _jump_table(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(A_k, C_k) for k = 1..n with state_k = A_k * state_0 + C_k (mod 2^64)."""
    a = np.empty(n, dtype=np.uint64)
    c = np.empty(n, dtype=np.uint64)
    ak, ck = 1, 0
    for k in range(n):
        ak, ck = (ak * MUL) & MASK, (ck * MUL + INC) & MASK
        a[k], c[k] = ak, ck
    return a, c


_TABLES: dict[int, tuple[np.ndarray, np.ndarray]] = {}


class Rng:
    def __init__(self, seed: int):
        self.state = (int(seed) + 1) & MASK

    def next_u32(self) -> int:
        self.state = (self.state * MUL + INC) & MASK
        return self.state >> 32

    def u32(self, n: int) -> np.ndarray:
        """The next n draws at once (same values as n calls of next_u32)."""
        if n not in _TABLES:
            _TABLES[n] = _jump_table(n)
        a, c = _TABLES[n]
        with np.errstate(over="ignore"):
            states = a * np.uint64(self.state) + c  # wraps mod 2^64
        self.state = int(states[-1])
        return (states >> np.uint64(32)).astype(np.uint64)

    def tokens(self, n: int, vocab: int) -> np.ndarray:
        """n uniform token ids in [0, vocab)."""
        return ((self.u32(n) * np.uint64(vocab)) >> np.uint64(32)).astype(np.int64)

    def uniforms(self, n: int) -> np.ndarray:
        """n floats in [0, 1) from the same stream (for the tempered categorical draw)."""
        return self.u32(n).astype(np.float64) / 2.0**32


def block_seed(seed: int, block: int, retry: int = 0) -> int:
    return (int(seed) + block * BLOCK_STRIDE + retry * RETRY_STRIDE) & MASK
