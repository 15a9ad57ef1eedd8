"""Preallocated KV cache: a ring of slots per sliding layer, a linear buffer per full layer, each with room for
a canvas right after what a denoise step reads, so that attention reads one contiguous slice."""

from __future__ import annotations

import hashlib

import torch

from diffgemma.config import ModelConfig

# Ring slots beyond the window: how far a conversation can rewind (e.g. to re-render a reply without its
# thought channel) before it must re-prefill.
REWIND_SLACK = 1024


def ring_slots(cfg: ModelConfig, max_tokens: int, rewind_slack: int = REWIND_SLACK) -> int:
    return min(max_tokens, cfg.sliding_window + max(2 * cfg.canvas_length, rewind_slack))


def _geometry(cfg: ModelConfig, max_tokens: int, ring_size: int) -> tuple[int, int]:
    """(period, mirror) of a sliding layer's ring: position p lives in slot p % period, and the first `mirror`
    slots are repeated after the last. A window (window - 1 positions from slot p % period < period) and a
    canvas after it are then one contiguous slice; period = ring_size + a canvas puts that canvas on slots of
    positions older than the ring_size ones a rewind may still need. A ring that never wraps is a linear
    buffer (no mirror)."""
    c = cfg.canvas_length
    period = ring_size + c
    if period >= max_tokens + c:
        return max_tokens + c, 0
    return period, cfg.sliding_window - 1 + c


def layer_slots(cfg: ModelConfig, layer: int, max_tokens: int, ring_size: int) -> int:
    """Slots of `layer`'s K (and V) buffer."""
    if not cfg.is_sliding(layer):
        return max_tokens + cfg.canvas_length
    period, mirror = _geometry(cfg, max_tokens, ring_size)
    return period + mirror


def cache_bytes(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, ring_size: int) -> int:
    """Bytes a KVCache of these dimensions allocates."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * layer_slots(cfg, i, max_tokens, ring_size) * cfg.num_kv_heads[i] * cfg.head_dims[i] * size
        for i in range(cfg.num_layers)
    )


def kv_layout(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, ring_size: int) -> str:
    """One line for a cache's layout: each kind of layer's [K/V, kv heads, slots, head_dim] buffers and bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    parts = []
    for kind, sliding in (("full", False), ("sliding", True)):
        layers = [i for i in range(cfg.num_layers) if cfg.is_sliding(i) == sliding]
        if not layers:
            continue
        i = layers[0]
        slots = layer_slots(cfg, i, max_tokens, ring_size)
        nbytes = len(layers) * 2 * slots * cfg.num_kv_heads[i] * cfg.head_dims[i] * size
        parts.append(
            f"{len(layers)} {kind} layers x [2, {cfg.num_kv_heads[i]}, {slots:,}, {cfg.head_dims[i]}] "
            f"({nbytes / 2**30:.2f} GiB)"
        )
    return "; ".join(parts)


class KVCache:
    """K and V for every layer, shaped [1, kv_heads, slots, head_dim]: views of one [2, kv_heads, slots,
    head_dim] buffer per layer, so that a canvas's K and V are stored by one copy.

    A sliding layer keeps a ring (`_geometry`); only the last `window - 1` positions are ever read, and the
    `ring_size` positions kept in all let `truncate` rewind without a re-prefill. A full layer keeps a linear
    buffer of `max_tokens` slots. Both have room for a canvas right after the span a denoise step reads, where
    `read_with` puts the canvas's K/V: those slots hold no position a read (or a rewind) can reach, and the
    next prefill overwrites them. `length` is the number of cached positions; `tokens` their ids, kept by
    `DiffusionGemma.prefill` (the aligned prefill recomputes the partial last chunk from them).
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
        self.canvas_slots = cfg.canvas_length
        self.ring_size = ring_size or ring_slots(cfg, max_tokens)
        if self.ring_size < min(max_tokens, self.window - 1):
            raise ValueError(f"ring_size {self.ring_size} is smaller than the window - 1 ({self.window - 1})")
        self.period, self.mirror = _geometry(cfg, max_tokens, self.ring_size)
        self.length = 0
        self.cut: int | None = None  # `take_cut`
        self.tokens: list[int] = []  # the ids at positions 0 .. length - 1, when the prefill wrote them
        # Oldest position every ring still holds: a write ending at e may overwrite any position < e - ring_size,
        # and a rewind does not bring those back (so length - ring_size alone says too much after a truncate).
        self.oldest = 0
        self.kv: list[torch.Tensor] = []  # [2, kv_heads, slots, head_dim]
        for i in range(cfg.num_layers):
            slots = layer_slots(cfg, i, max_tokens, self.ring_size)
            shape = (2, cfg.num_kv_heads[i], slots, cfg.head_dims[i])
            self.kv.append(torch.zeros(shape, device=device, dtype=dtype))
        self.k = [t[0:1] for t in self.kv]
        self.v = [t[1:2] for t in self.kv]

    @property
    def device(self) -> torch.device:
        return self.kv[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def window_positions(self, end: int) -> torch.Tensor:
        """Positions a sliding layer still sees before `end`: [end - (window - 1), end)."""
        return torch.arange(self._window_start(end), end, device=self.device)

    def _window_start(self, end: int) -> int:
        return max(0, end - (self.window - 1))

    def _span(self, layer: int, end: int) -> tuple[int, int]:
        """Slots [a, b) that hold, in position order, what `layer` attends to before position `end`."""
        return self._sliding_span(end) if self.cfg.is_sliding(layer) else (0, end)

    def _sliding_span(self, end: int) -> tuple[int, int]:
        start = self._window_start(end)
        a = start % self.period
        return a, a + end - start

    def span(self, layer: int, end: int) -> torch.Tensor:
        """K and V [2, kv_heads, n, head_dim] of what `layer` attends to before position `end`, in position
        order: a view of the cache, valid until the next `write`."""
        a, b = self._span(layer, end)
        return self.kv[layer][:, :, a:b]

    def read(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V and positions of what `layer` attends to before position `end` (default: the cache length).

        Full layers: views. Sliding layers: copies, as a later `write` may overwrite those slots."""
        end = self.length if end is None else end
        kv = self.span(layer, end)
        if self.cfg.is_sliding(layer):
            kv = kv.clone()
            return kv[0:1], kv[1:2], self.window_positions(end)
        return kv[0:1], kv[1:2], torch.arange(0, end, device=self.device)

    def read_with(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of what `layer` attends to at the cache length, followed by a canvas's own k/v [1, h, C, d].

        The canvas goes to the free slots right after the cached span and the result is a view of the span
        and the canvas: no copy of the prefix, no gather (nothing else reads those slots, see the class). A
        canvas longer than the room, or in another dtype, is concatenated instead."""
        c = k.shape[2]
        if c > self.canvas_slots or k.dtype != self.dtype:
            past_k, past_v, _ = self.read(layer)
            return torch.cat([past_k.to(k.dtype), k], dim=2), torch.cat([past_v.to(v.dtype), v], dim=2)
        a, b = self._span(layer, self.length)
        self.k[layer][:, :, b : b + c].copy_(k)
        self.v[layer][:, :, b : b + c].copy_(v)
        return self.k[layer][:, :, a : b + c], self.v[layer][:, :, a : b + c]

    def denoise_geometry(self, c: int) -> list[int]:
        """Where a denoise step of a canvas of c positions reads and writes, for kernels that take it on the
        device: [length (the full layers' canvas slot and the canvas's first position), the first slot of a
        sliding layer's keys, their count with the canvas, that canvas's first slot, the full layers' key count
        with the canvas]. A sliding layer's keys are the window before the canvas and the canvas, contiguous."""
        a, b = self._sliding_span(self.length)
        return [self.length, a, b + c - a, b, self.length + c]

    def denoise_key_slots(self, c: int) -> int:
        """The most keys a sliding layer's denoise reads with a canvas of c (`denoise_geometry`'s count)."""
        return min(self.window - 1, self.max_tokens) + c

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store K and V stacked [2, heads, T, d] for positions start .. start+T-1 (does not move `length`)."""
        t = kv.shape[2]
        if start + t > self.max_tokens:
            raise ValueError(f"KV cache full: {start + t} tokens > max_tokens {self.max_tokens}")
        kv = kv.to(self.dtype)
        if not self.cfg.is_sliding(layer):
            self.kv[layer][:, :, start : start + t] = kv
            return
        keep = min(t, self.ring_size)
        self.oldest = max(self.oldest, start + t - self.ring_size)
        first = start + t - keep  # positions first.. go to slots first % period.., wrapping at most once
        a = first % self.period
        n = min(keep, self.period - a)
        self._put(layer, a, kv[:, :, t - keep : t - keep + n])
        if n < keep:
            self._put(layer, 0, kv[:, :, t - keep + n :])

    def _put(self, layer: int, a: int, kv: torch.Tensor) -> None:
        """K and V into ring slots a.. (no wrap), and the part below `mirror` into its mirror slots too."""
        b = a + kv.shape[2]
        self.kv[layer][:, :, a:b] = kv
        m = min(b, self.mirror) - a
        if m > 0:
            self.kv[layer][:, :, self.period + a : self.period + a + m] = kv[:, :, :m]

    def can_truncate(self, pos: int) -> bool:
        """True when the rings still hold the window that precedes `pos`."""
        if not 0 <= pos <= self.length:
            return False
        oldest_in_ring = max(0, self.length - self.ring_size, self.oldest)
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
        self._note_cut(pos)
        self.length = pos
        del self.tokens[pos:]

    def reset(self) -> None:
        self._note_cut(0)
        self.length = 0
        self.oldest = 0
        self.tokens = []

    def _note_cut(self, pos: int) -> None:
        if pos < self.length:
            self.cut = pos if self.cut is None else min(self.cut, pos)

    def take_cut(self) -> int | None:
        """The lowest position a truncate or reset has cut back to since the last call (None: no cut): what the
        token pipeline's epochs track."""
        cut, self.cut = self.cut, None
        return cut

    def knows_tokens(self) -> bool:
        """Whether `tokens` holds the id of every cached position (false for K/V written some other way)."""
        return len(self.tokens) == self.length

    def fingerprint(self) -> str:
        """SHA-256 of the live K/V of every layer in position order (what attention can still read)."""
        h = hashlib.sha256()
        h.update(str(self.length).encode())
        for i in range(self.cfg.num_layers):
            k, v, _ = self.read(i)
            for t in (k, v):
                h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
