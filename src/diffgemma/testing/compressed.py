"""Tiny DiffusionGemma checkpoints in the community compressed-tensors FP8 layout (llm-compressor's FP8_DYNAMIC),
written by our own code from `write_tiny_checkpoint`: the layout is described in `diffgemma.weights.community`.

The source weights are cast to bf16 (as the released checkpoints are) and each quantized Linear is rounded as
llm-compressor's min-max observer and compressor do in the weight's dtype: scale = amax / 448 (per output row for
the channel strategy, over the whole matrix for the tensor one; a zero scale becomes the dtype's eps), data =
fp8(clamp(w / scale, -448, 448)). Alongside, the dequantized reference under our names (fp8 values times their
scales, in fp32): what the loaded model's weights must equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from diffgemma.testing.checkpoint import write_tiny_checkpoint

FP8_MAX = 448.0
DECODER = "model.decoder."
LINEARS = (  # our Linears under layers.N. that the recipe quantizes
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
SC_LINEARS = tuple(f"self_conditioning.{p}_proj.weight" for p in ("gate", "up", "down"))
IGNORE = [  # the FP8-dynamic recipes' ignore list for Gemma 4 (module names and `re:` regexes)
    "lm_head",
    "re:.*embed_tokens.*",
    "re:.*router.*",
    "re:.*norm.*",
    "re:.*vision_tower.*",
    "re:.*embed_vision.*",
]


def _args(strategy: str, dynamic: bool, observer: str | None) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": None,
        "num_bits": 8,
        "observer": observer,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def quantization_config(strategy: str = "channel", ignore: list[str] | None = None) -> dict[str, Any]:
    """The config.json `quantization_config` llm-compressor writes for an FP8 (dynamic activations) scheme."""
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": _args("token", True, None),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": _args(strategy, False, "minmax"),
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": list(IGNORE if ignore is None else ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def quantize_fp8(w: torch.Tensor, per: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, scale) of w [..., N, K]: `per` "row" (channel: scale [..., N, 1]), "matrix" (tensor: one scale
    a matrix, [..., 1, 1]) or "all" (one scale, shape [1]); computed in w's dtype as llm-compressor does."""
    if per == "row":
        amax = w.abs().amax(-1, keepdim=True)
    elif per == "matrix":
        amax = w.abs().amax(dim=(-2, -1), keepdim=True)
    else:
        amax = w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    data = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale.to(scale_dtype)


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.float() * scale.float()


def write_tiny_compressed_fp8(
    path: str | Path,
    seed: int = 0,
    *,
    experts: str = "per_expert",
    strategy: str = "channel",
    scale_dtype: torch.dtype = torch.bfloat16,
    quantize_self_conditioning: bool = True,
    **overrides: Any,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write a tiny checkpoint in the compressed-tensors FP8 layout: `experts` "per_expert" (experts.{e}.gate_proj
    / up_proj / down_proj Linears, as llm-compressor writes them) or "fused" (experts.gate_up_proj / down_proj
    float8 with `_scale` [E, N, 1], or [E, 2] / [E, 1] for the tensor strategy); `strategy` "channel" or "tensor";
    scales in `scale_dtype`. `overrides` go to `write_tiny_checkpoint`. Returns the path and the dequantized
    reference: every quantized weight under our name (experts stacked [E, 2I, H] / [E, H, I]), in fp32."""
    if experts not in ("per_expert", "fused") or strategy not in ("channel", "tensor"):
        raise ValueError(
            f"experts must be per_expert or fused and strategy channel or tensor, not {experts}, {strategy}"
        )
    if overrides.get("shards", 1) != 1:
        raise ValueError("write_tiny_compressed_fp8 writes one model.safetensors (no shards)")
    path = write_tiny_checkpoint(path, seed, **overrides)
    source = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    ignore = IGNORE + ([] if quantize_self_conditioning else ["re:.*self_conditioning.*"])
    config["quantization_config"] = quantization_config(strategy, ignore)
    per = "row" if strategy == "channel" else "all"

    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}

    def linear(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale = quantize_fp8(w, per, scale_dtype)
        out[name], out[name + "_scale"] = data, scale
        return data, scale

    targets = set(LINEARS)
    for name, t in source.items():
        w = t.to(torch.bfloat16)
        suffix = name.split(".", 4)[-1] if name.startswith(DECODER + "layers.") else None
        top = name.removeprefix(DECODER)
        if suffix in targets or (quantize_self_conditioning and top in SC_LINEARS):
            data, scale = linear(name, w)
            reference[name] = _dequant(data, scale)
        elif suffix in ("experts.gate_up_proj", "experts.down_proj"):
            reference[name] = _experts(name, w, experts, strategy, scale_dtype, out)
        else:
            out[name] = w
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, reference


def _experts(
    name: str,
    w: torch.Tensor,
    layout: str,
    strategy: str,
    scale_dtype: torch.dtype,
    out: dict[str, torch.Tensor],
) -> torch.Tensor:
    """One fused expert stack written in `layout` into `out`; returns its dequantized [E, N, K] reference."""
    gate_up = name.endswith("gate_up_proj")
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    parts = ("gate", "up") if gate_up else ("down",)
    per = "row" if strategy == "channel" else "all"
    rows = []
    if layout == "per_expert":  # llm-compressor's unfused Linears: experts.{e}.{proj}_proj.weight [+ _scale]
        stem = name.removesuffix("gate_up_proj" if gate_up else "down_proj")
        for e in range(w.shape[0]):
            chunks = []
            for j, proj in enumerate(parts):
                key = f"{stem}{e}.{proj}_proj.weight"
                data, scale = quantize_fp8(w[e, j * n : (j + 1) * n].contiguous(), per, scale_dtype)
                out[key], out[key + "_scale"] = data, scale
                chunks.append(_dequant(data, scale))
            rows.append(torch.cat(chunks))
        return torch.stack(rows)
    # fused: the whole stack in fp8, per (expert, row) scales or one a (expert, projection)
    if strategy == "channel":
        data, scale = quantize_fp8(w, "row", scale_dtype)
        out[name], out[name + "_scale"] = data, scale
        return _dequant(data, scale)
    halves = [quantize_fp8(w[:, j * n : (j + 1) * n], "matrix", scale_dtype) for j in range(len(parts))]
    out[name] = torch.cat([d for d, _ in halves], dim=1)
    out[name + "_scale"] = torch.cat([s.reshape(-1, 1) for _, s in halves], dim=1)  # [E, 2] or [E, 1]
    return torch.cat([_dequant(d, s) for d, s in halves], dim=1)
