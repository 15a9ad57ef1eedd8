"""The weight formats of a pack: each one's encoder, its decoder (the torch reference every kernel is pinned to)
and the tensors it writes. The on-disk layout of each is in docs/quantization.md.

A weight W [..., N, K] (K the input dimension, the last) becomes its data tensor, under W's own name, and
companions named `<name>_scale`, `<name>_zero`, `<name>_high`, `<name>_scale_2`. Which format a tensor is in
follows from those tensors alone (`detect`): a pack is read without its profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("bf16", "q8", "int4", "q5", "q6", "fp8", "nvfp4")
GROUP = 32  # int4 / q5 / q6: one scale and one zero point per 32 inputs
NVFP4_BLOCK = 16
FP8_MAX = 448.0  # float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
LEVELS = {"int4": 15, "q5": 31, "q6": 63}
# int4's scale is bf16 so that the GPU decodes in bf16 and rounds once, exactly as `decode` does (one bf16 product
# of q - z and the scale, docs/performance.md, "Quantized weights"); q5 / q6 keep fp16's three more bits
SCALE_DTYPE = {"int4": torch.bfloat16, "q5": torch.float16, "q6": torch.float16}
HIGH_PER_BYTE = {"q5": 8, "q6": 4}  # bits above the low nibble: 1 (q5) or 2 (q6) a value
COMPANIONS = ("_scale", "_zero", "_high", "_scale_2")


class FormatError(ValueError):
    """A tensor cannot take a format, or a pack's tensors do not make up any format."""


def dims_problem(fmt: str, shape: tuple[int, ...]) -> str | None:
    """Why a tensor of this shape cannot take `fmt`, or None when it can (the seed's dimension rules)."""
    if fmt == "bf16":
        return None
    if len(shape) < 2:
        return f"{fmt} needs a matrix (rank 2 or more), not shape {tuple(shape)}"
    k = shape[-1]
    if fmt in LEVELS and k % GROUP:
        return f"{fmt} needs the input dimension a multiple of {GROUP}, not {k}"
    if fmt == "nvfp4" and k % NVFP4_BLOCK:
        return f"nvfp4 needs the input dimension a multiple of {NVFP4_BLOCK}, not {k}"
    return None


def _check(fmt: str, w: torch.Tensor) -> None:
    problem = dims_problem(fmt, tuple(w.shape))
    if problem:
        raise FormatError(problem)


# -- encoders: a float weight -> {suffix: tensor} ("" is the data, under the weight's own name) ----------


def encode(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """W in `fmt`: its data and companions, keyed by name suffix. bf16 keeps W's bytes as they are."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
    _check(fmt, w)
    if fmt == "bf16":
        return {"": w}
    x = w.float()
    if fmt == "q8":
        scale = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        return {"": torch.round(x / scale).clamp(-127, 127).to(torch.int8), "_scale": scale}
    if fmt == "fp8":
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return {"": (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "_scale": scale}
    if fmt == "nvfp4":
        return _encode_nvfp4(x)
    return _encode_affine(x, fmt)


def _encode_affine(x: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Group-32 affine: w = scale * (q - zero), q and zero in [0, levels]; the range includes 0, so that zero is
    a level and a constant group is exact."""
    levels = LEVELS[fmt]
    g = x.unflatten(-1, (-1, GROUP))  # [..., N, G, 32]
    lo = g.amin(-1).clamp_max(0.0)
    hi = g.amax(-1).clamp_min(0.0)
    # rounded first: q uses the stored scale
    scale = ((hi - lo) / levels).clamp_min(2.0**-24).to(SCALE_DTYPE[fmt])
    s = scale.float()
    zero = torch.round(-lo / s).clamp(0, levels)
    q = (torch.round(g / s[..., None]) + zero[..., None]).clamp(0, levels).to(torch.uint8).flatten(-2)
    out = {"": _pack_nibbles(q & 15), "_scale": scale}
    zero = zero.to(torch.uint8)
    if fmt == "int4":
        out["_zero"] = _pack_nibbles(
            zero if zero.shape[-1] % 2 == 0 else torch.nn.functional.pad(zero, (0, 1))
        )
        return out
    out["_zero"] = zero
    per = HIGH_PER_BYTE[fmt]
    bits = 8 // per
    high = (q >> 4).unflatten(-1, (-1, per)).to(torch.int32)
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    out["_high"] = (high << shifts).sum(-1).to(torch.uint8)
    return out


def _encode_nvfp4(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """e2m1 values in blocks of 16, each block with an e4m3 scale, each matrix with an fp32 scale:
    w = e2m1 * block_scale * scale_2."""
    amax = x.abs().amax(dim=(-2, -1))  # one per matrix
    scale_2 = torch.where(amax > 0, amax / (FP8_MAX * 6.0), torch.ones_like(amax))
    b = x.unflatten(-1, (-1, NVFP4_BLOCK))  # [..., N, K/16, 16]
    s2 = scale_2[..., None, None]
    block = (b.abs().amax(-1) / 6.0 / s2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    bs = block.float() * s2
    v = b / torch.where(bs > 0, bs, torch.ones_like(bs))[..., None]
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    idx = torch.bucketize(v.abs().clamp(max=6.0), mids, right=False).to(torch.uint8)
    # ties at a midpoint go to the lower value (bucketize, right=False), as round-half-down
    code = (idx | ((v < 0).to(torch.uint8) << 3)).flatten(-2)
    return {"": _pack_nibbles(code), "_scale": block, "_scale_2": scale_2.float()}


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16 [..., 2M] -> [..., M] bytes: element 2i in the low nibble, 2i + 1 in the high one."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


# -- decoders: the torch reference ----------------------------------------------------------------------


def decode(fmt: str, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [..., N, K] a format's tensors stand for (computed in fp32, returned in dtype)."""
    data = t[""]
    if fmt == "bf16":
        return data.to(dtype)
    if fmt in ("q8", "fp8"):
        return (data.float() * t["_scale"].float()).to(dtype)
    if fmt == "nvfp4":
        lut = torch.tensor(E2M1_VALUES, device=data.device)
        code = _unpack_nibbles(data).long()
        v = lut[code & 7] * (1.0 - 2.0 * (code >> 3).float())
        s2 = t["_scale_2"].float()
        s2 = s2 if s2.dim() == data.dim() else s2[..., None, None]  # in memory [..., N, 1]; on disk [...]
        bs = t["_scale"].float() * s2
        return (v.unflatten(-1, (-1, NVFP4_BLOCK)) * bs[..., None]).flatten(-2).to(dtype)
    q = _unpack_nibbles(data)
    if fmt in HIGH_PER_BYTE:
        per = HIGH_PER_BYTE[fmt]
        bits = 8 // per
        shifts = torch.arange(per, device=data.device, dtype=torch.uint8) * bits
        high = ((t["_high"][..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)
        q = q | (high << 4)
        zero = t["_zero"].float()
    else:
        zero = _unpack_nibbles(t["_zero"]).float()
    g = q.float().unflatten(-1, (-1, GROUP))
    groups = g.shape[-2]
    w = (g - zero[..., :groups, None]) * t["_scale"].float()[..., None]
    return w.flatten(-2).to(dtype)


# -- what a pack's tensors say -------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and shape (from a safetensors header: no data read)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def layout(fmt: str, shape: tuple[int, ...]) -> dict[str, TensorInfo]:
    """The tensors `fmt` stores for a weight of logical shape [..., N, K]: {suffix: (dtype, shape)}. The float
    formats' dtype is the source's (any float type); it is reported as bf16 here."""
    if fmt == "bf16":
        return {"": TensorInfo(torch.bfloat16, tuple(shape))}
    *lead, n, k = shape
    lead = tuple(lead)
    if fmt in ("q8", "fp8"):
        dt = torch.int8 if fmt == "q8" else torch.float8_e4m3fn
        return {"": TensorInfo(dt, tuple(shape)), "_scale": TensorInfo(torch.float32, (*lead, n, 1))}
    if fmt == "nvfp4":
        return {
            "": TensorInfo(torch.uint8, (*lead, n, k // 2)),
            "_scale": TensorInfo(torch.float8_e4m3fn, (*lead, n, k // NVFP4_BLOCK)),
            "_scale_2": TensorInfo(torch.float32, lead),
        }
    groups = k // GROUP
    out = {
        "": TensorInfo(torch.uint8, (*lead, n, k // 2)),
        "_scale": TensorInfo(SCALE_DTYPE[fmt], (*lead, n, groups)),
    }
    if fmt == "int4":
        out["_zero"] = TensorInfo(torch.uint8, (*lead, n, (groups + 1) // 2))
    else:
        out["_zero"] = TensorInfo(torch.uint8, (*lead, n, groups))
        out["_high"] = TensorInfo(torch.uint8, (*lead, n, k // HIGH_PER_BYTE[fmt]))
    return out


def detect(name: str, found: dict[str, TensorInfo], shape: tuple[int, ...]) -> str:
    """The format of the weight `name` of logical `shape`, from its stored tensors ({suffix: info}); raises
    FormatError naming the tensor when they make up no format or do not match the shape."""
    data = found.get("")
    if data is None:
        raise FormatError(f"tensor {name} is missing")
    if data.dtype.is_floating_point and data.dtype != torch.float8_e4m3fn:
        fmt = "bf16"
    elif data.dtype == torch.int8:
        fmt = "q8"
    elif data.dtype == torch.float8_e4m3fn:
        fmt = "fp8"
    elif data.dtype == torch.uint8:
        scale = found.get("_scale")
        if scale is None:
            raise FormatError(f"tensor {name} is uint8 without {name}_scale")
        if scale.dtype == torch.float8_e4m3fn:
            fmt = "nvfp4"
        elif "_high" not in found:
            fmt = "int4"
        else:
            fmt = "q5" if found["_high"].shape[-1] * HIGH_PER_BYTE["q5"] == shape[-1] else "q6"
    else:
        raise FormatError(f"tensor {name} is {data.dtype}: no weight format stores that")
    problem = dims_problem(fmt, shape)
    if problem:
        raise FormatError(f"tensor {name}: {problem}")
    want = layout(fmt, shape)
    for suffix in found:
        if suffix not in want:
            raise FormatError(f"tensor {name}{suffix} does not belong to a {fmt} weight")
    for suffix, info in want.items():
        got = found.get(suffix)
        if fmt == "bf16":
            break  # any float dtype; its shape is the loader's to check
        if got is None:
            raise FormatError(f"tensor {name}{suffix} is missing (a {fmt} weight needs it)")
        if got.shape != info.shape:
            raise FormatError(
                f"tensor {name}{suffix} has shape {got.shape}; a {fmt} weight of shape {tuple(shape)} "
                f"needs {info.shape}"
            )
        if suffix and got.dtype != info.dtype:
            raise FormatError(f"tensor {name}{suffix} is {got.dtype}; a {fmt} weight needs {info.dtype}")
    return fmt


def error_bound(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """Each element's worst-case |decode(encode(w)) - w| for `fmt` (what the round-trip tests hold to)."""
    x = w.float()
    if fmt == "bf16":
        return torch.zeros_like(x)
    if fmt == "q8":
        return (x.abs().amax(-1, keepdim=True) / 127.0 * 0.5001).expand_as(x)
    if fmt == "fp8":  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals step scale * 2^-9
        scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
        return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * 1.0001
    if fmt == "nvfp4":  # the widest e2m1 gap (4 to 6) at the block's scale, rounded up for the e4m3 scale
        amax = x.abs().amax(dim=(-2, -1), keepdim=True)[..., None]  # [..., 1, 1, 1] beside the blocks
        b = x.unflatten(-1, (-1, NVFP4_BLOCK)).abs().amax(-1, keepdim=True)
        # (a block that rounds to a zero scale decodes to 0: |w| < 6 * scale_2 * 2^-10 there)
        bound = b / 6.0 * (1 + 2.0**-3) + amax / (FP8_MAX * 6.0) * 2.0**-6
        return bound.expand(*b.shape[:-1], NVFP4_BLOCK).flatten(-2)
    levels = LEVELS[fmt]
    g = x.unflatten(-1, (-1, GROUP))
    s = (g.amax(-1, keepdim=True).clamp_min(0) - g.amin(-1, keepdim=True).clamp_max(0)) / levels
    # half a level, plus the scale's rounding (half its ulp, relative) over as many as `levels` levels
    rounding = 2.0**-8 if fmt == "int4" else 2.0**-11
    return (s * (0.5 + levels * rounding) * 1.001 + 2.0**-24).expand_as(g).flatten(-2)
