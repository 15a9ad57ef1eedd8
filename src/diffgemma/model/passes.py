"""`Pass`: what one forward covers. Its phase, the caches it reads and writes (one per row) and where its tokens
sit, so that the layers and their kernels read every position, slot and mask from one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffgemma.kernels import torch_ref as ref
from diffgemma.model.kv_cache import KVCache

PREFILL = "prefill"  # causal over the cache and the chunk; writes the chunk's K/V (the encoder's role)
DENOISE = (
    "denoise"  # a canvas over the cache and itself, bidirectionally; reads the cache (the decoder's role)
)
COMMIT = "commit"  # a prefill run on a denoise step's canvas slots (the fast path's way to commit a block)
TRAIN = "train"  # the trainer's joint pass over [prompt | canvas] with explicit masks


@dataclass
class Pass:
    phase: str
    caches: list[KVCache]  # one per row (none for TRAIN)
    t: int  # tokens a row
    positions: torch.Tensor  # [B * T] on the device
    starts: list[int]  # each row's first position
    valid: int | None = None  # PREFILL: the real rows of a padded chunk; the rest write nothing
    # The fast kernels' canvas passes, read on the device so that a CUDA graph serves every cache length: each
    # row's `KVCache.denoise_geometry` (int32 [B, 5]) and the keys its full layers attend over (a bucket of them).
    geometry: torch.Tensor | None = None
    full_keys: list[int] | None = None
    # The fast kernels' batched denoise: each row's cache's layer buffers as the ragged attention reads them,
    # int64 [layers, B, 2] on the device (`triton_ragged.kv_table`); made by the runner outside a graph
    kv_tables: torch.Tensor | None = None
    window_bias: torch.Tensor | None = None  # PREFILL on the fast kernels: the sliding layers' mask
    masks: dict[bool, torch.Tensor] | None = None  # TRAIN: [B, 1, T, T] True = attend, by `sliding`
    is_prompt: torch.Tensor | None = None  # TRAIN: [1, T, 1] True on prompt slots (the encoder's scalar)
    rope: dict = field(default_factory=dict)  # cos/sin [B * T, d] by (layer type, dtype), made on first use

    @property
    def batch(self) -> int:
        return self.positions.shape[0] // self.t

    def cos_sin(self, layer_type: str, inv_freq: torch.Tensor, dtype: torch.dtype):
        """RoPE's cos/sin tables for this pass's positions, once per layer type and dtype."""
        key = (layer_type, dtype)
        if key not in self.rope:
            self.rope[key] = ref.rope_cos_sin(inv_freq, self.positions, dtype)
        return self.rope[key]

    def scalar(self, layer) -> torch.Tensor:
        """The layer's output scalar: the encoder's copy where tokens are prefilled, the decoder's on a canvas."""
        if self.phase == TRAIN:
            return torch.where(self.is_prompt, layer.encoder_layer_scalar, layer.layer_scalar)
        return layer.encoder_layer_scalar if self.phase in (PREFILL, COMMIT) else layer.layer_scalar

    @classmethod
    def prefill(cls, caches: list[KVCache], t: int, valid: int | None = None) -> Pass:
        """A causal chunk of t tokens a row after each cache's positions (`valid` of them real, the rest pads)."""
        starts = [kv.length for kv in caches]
        device = caches[0].device
        positions = torch.cat([torch.arange(s, s + t, device=device) for s in starts])
        return cls(PREFILL, caches, t, positions, starts, valid=valid)

    @classmethod
    def denoise(
        cls,
        caches: list[KVCache],
        c: int,
        geometry: torch.Tensor | None = None,
        full_keys: list[int] | None = None,
        phase: str = DENOISE,
        kv_tables: torch.Tensor | None = None,
    ) -> Pass:
        """A canvas of c tokens a row after each cache. With `geometry` (a device buffer [B, 5] holding each
        cache's `denoise_geometry(c)`, as a CUDA graph reads it) the positions are computed from it on the
        device."""
        starts = [kv.length for kv in caches]
        device = caches[0].device
        if geometry is not None:
            positions = (geometry[:, :1] + torch.arange(c, device=device)).reshape(-1)
        else:
            positions = torch.cat([torch.arange(s, s + c, device=device) for s in starts])
        return cls(
            phase, caches, c, positions, starts, geometry=geometry, full_keys=full_keys, kv_tables=kv_tables
        )

    @classmethod
    def train(
        cls, positions: torch.Tensor, t: int, masks: dict[bool, torch.Tensor], is_prompt: torch.Tensor
    ) -> Pass:
        return cls(TRAIN, [], t, positions.reshape(-1), [], masks=masks, is_prompt=is_prompt)
