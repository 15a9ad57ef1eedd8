"""A quantized weight in memory: its format, logical shape and stored tensors, with the dequantizing reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffgemma.quant import formats


@dataclass
class QuantWeight:
    """A weight [..., N, K] held in `fmt` (never bf16: a bf16 weight is a plain tensor). `parts`: the format's
    tensors by suffix ("" the data), as in a pack, except nvfp4's scale_2, held per row ([..., N, 1]) so that
    weights concatenate along N (`cat`)."""

    fmt: str
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor] = field(repr=False)

    @classmethod
    def from_pack(cls, fmt: str, shape: tuple[int, ...], parts: dict[str, torch.Tensor]) -> QuantWeight:
        parts = dict(parts)
        if fmt == "nvfp4":
            s2 = parts["_scale_2"].float()
            parts["_scale_2"] = s2[..., None, None].expand(*shape[:-1], 1).contiguous()
        return cls(fmt, tuple(shape), parts)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> QuantWeight:
        """w encoded in `fmt` (on w's device)."""
        return cls.from_pack(fmt, tuple(w.shape), formats.encode(w, fmt))

    @property
    def device(self) -> torch.device:
        return self.parts[""].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return formats.decode(self.fmt, self.parts, dtype)

    def to_device(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.fmt, self.shape, {s: t.to(device) for s, t in self.parts.items()})

    def __getitem__(self, e: int) -> QuantWeight:
        """Expert e of a stacked [E, N, K] weight."""
        return QuantWeight(self.fmt, self.shape[1:], {s: t[e] for s, t in self.parts.items()})

    @staticmethod
    def cat(weights: list[QuantWeight]) -> QuantWeight:
        """Weights of one format stacked along N (q; k; v as one GEMM's weight)."""
        fmt = weights[0].fmt
        if any(w.fmt != fmt or w.shape[-1] != weights[0].shape[-1] for w in weights):
            raise ValueError("only weights of one format and one input dimension concatenate")
        parts = {s: torch.cat([w.parts[s] for w in weights], dim=-2) for s in weights[0].parts}
        n = sum(w.shape[-2] for w in weights)
        return QuantWeight(fmt, (*weights[0].shape[:-2], n, weights[0].shape[-1]), parts)


def dense(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a plain tensor in dtype: dequantized when quantized (the reference's way to run a format)."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)
