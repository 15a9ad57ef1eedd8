"""Preallocated KV cache: a ring of slots per sliding layer, a linear buffer per full layer."""

from __future__ import annotations

import hashlib

import torch

from diffgemma.config import ModelConfig

# Ring slots beyond the window: how far a conversation can rewind (e.g. to re-render a reply without its
# thought channel) before it must re-prefill.
REWIND_SLACK = 1024


def ring_slots(cfg: ModelConfig, max_tokens: int, rewind_slack: int = REWIND_SLACK) -> int:
    return min(max_tokens, cfg.sliding_window + max(2 * cfg.canvas_length, rewind_slack))


def cache_bytes(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, ring_size: int) -> int:
    """Bytes a KVCache of these dimensions allocates."""
    size = torch.empty((), dtype=dtype).element_size()
    slots = [ring_size if cfg.is_sliding(i) else max_tokens for i in range(cfg.num_layers)]
    return sum(2 * s * cfg.num_kv_heads[i] * cfg.head_dims[i] * size for i, s in enumerate(slots))


class KVCache:
    """K and V for every layer, shaped [1, kv_heads, slots, head_dim].

    A sliding layer keeps a ring of `ring_size` slots (position p lives in slot p % ring_size); only the last
    `window - 1` positions are ever read, so the slack above that lets `truncate` rewind without a re-prefill.
    A full layer keeps a linear buffer of `max_tokens` slots. `length` is the number of cached positions.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_tokens: int,
        device: torch.device | str,
        dtype: torch.dtype,
        ring_size: int | None = None,
    ):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.window = cfg.sliding_window
        self.ring_size = ring_size or ring_slots(cfg, max_tokens)
        if self.ring_size < min(max_tokens, self.window - 1):
            raise ValueError(f"ring_size {self.ring_size} is smaller than the window - 1 ({self.window - 1})")
        self.length = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i in range(cfg.num_layers):
            slots = self.ring_size if cfg.is_sliding(i) else max_tokens
            shape = (1, cfg.num_kv_heads[i], slots, cfg.head_dims[i])
            self.k.append(torch.zeros(shape, device=device, dtype=dtype))
            self.v.append(torch.zeros(shape, device=device, dtype=dtype))

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def window_positions(self, end: int) -> torch.Tensor:
        """Positions a sliding layer still sees before `end`: [end - (window - 1), end)."""
        start = max(0, end - (self.window - 1))
        return torch.arange(start, end, device=self.device)

    def read(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V and positions of what `layer` attends to before position `end` (default: the cache length)."""
        end = self.length if end is None else end
        if self.cfg.is_sliding(layer):
            pos = self.window_positions(end)
            slots = pos % self.ring_size
            return self.k[layer][:, :, slots], self.v[layer][:, :, slots], pos
        pos = torch.arange(0, end, device=self.device)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], pos

    def read_with(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of what `layer` attends to at the cache length, followed by a canvas's own k/v [1, h, C, d].

        A full layer with room places the canvas in its linear buffer's scratch slots [length, length + C)
        and returns views: no copy of the (long) prefix. Those slots are beyond `length`, so nothing that
        reads the cache sees them, and the next prefill overwrites them. Sliding layers concatenate (small)."""
        c = k.shape[2]
        end = self.length
        if not self.cfg.is_sliding(layer) and end + c <= self.max_tokens:
            self.k[layer][:, :, end : end + c] = k.to(self.dtype)
            self.v[layer][:, :, end : end + c] = v.to(self.dtype)
            return self.k[layer][:, :, : end + c], self.v[layer][:, :, : end + c]
        past_k, past_v, _ = self.read(layer)
        return torch.cat([past_k.to(k.dtype), k], dim=2), torch.cat([past_v.to(v.dtype), v], dim=2)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [1, heads, T, d] for positions start .. start+T-1 (does not move `length`)."""
        t = k.shape[2]
        if start + t > self.max_tokens:
            raise ValueError(f"KV cache full: {start + t} tokens > max_tokens {self.max_tokens}")
        if self.cfg.is_sliding(layer):
            keep = min(t, self.ring_size)
            slots = torch.arange(start + t - keep, start + t, device=self.device) % self.ring_size
            self.k[layer][:, :, slots] = k[:, :, t - keep :].to(self.dtype)
            self.v[layer][:, :, slots] = v[:, :, t - keep :].to(self.dtype)
        else:
            self.k[layer][:, :, start : start + t] = k.to(self.dtype)
            self.v[layer][:, :, start : start + t] = v.to(self.dtype)

    def can_truncate(self, pos: int) -> bool:
        """True when the rings still hold the window that precedes `pos`."""
        if not 0 <= pos <= self.length:
            return False
        oldest_in_ring = max(0, self.length - self.ring_size)
        return max(0, pos - (self.window - 1)) >= oldest_in_ring

    def truncate(self, pos: int) -> None:
        """Drop every position >= pos. Raises when a ring has already overwritten the window before `pos`."""
        if not 0 <= pos <= self.length:
            raise ValueError(f"cannot truncate to {pos}: cache holds {self.length} positions")
        if not self.can_truncate(pos):
            raise ValueError(
                f"cannot truncate to {pos}: the sliding-window ring ({self.ring_size} slots) no longer holds "
                f"positions {max(0, pos - self.window + 1)}..{pos - 1}; re-prefill instead"
            )
        self.length = pos

    def reset(self) -> None:
        self.length = 0

    def fingerprint(self) -> str:
        """SHA-256 of the live K/V of every layer in position order (what attention can still read)."""
        h = hashlib.sha256()
        h.update(str(self.length).encode())
        for i in range(self.cfg.num_layers):
            k, v, _ = self.read(i)
            for t in (k, v):
                h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
