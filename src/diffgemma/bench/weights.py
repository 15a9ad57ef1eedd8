"""The weights measured: random at a shape on the device, a checkpoint, quantized in place; their bytes."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch

from diffgemma.config import ModelConfig
from diffgemma.model.model import DiffusionGemma


@torch.no_grad()
def random_model(
    cfg_dict: dict[str, Any], device: str, dtype: torch.dtype, seed: int = 0, init: str = "wide"
) -> DiffusionGemma:
    """Our model with random weights made on `device` in `dtype`.

    init="wide": statistics as testing.random_tensors (norm weights 1 +- 0.3, router x4, scalars in
    [0.5, 1.5)): exercises every weight, but in bf16 the 30-layer network is chaotic (rounding flips top-k
    expert choices), so two correct bf16 implementations do not agree on the logits.
    init="hf": transformers' own DiffusionGemmaPreTrainedModel._init_weights: normal(0, initializer_range
    = 0.02) for every linear, embedding and expert tensor; RMSNorm weights, router scale, per_expert_scale
    and layer_scalar = 1. The distribution the bf16 check against transformers is run on."""
    if init not in ("wide", "hf"):
        raise ValueError(f"init must be 'wide' or 'hf', not {init!r}")
    from diffgemma.weights.loader import checkpoint_names

    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    h = cfg.hidden_size

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(std)

    for name, module, attr in checkpoint_names(model):
        shape = tuple(getattr(module, attr).shape)
        if init == "hf":
            ones = "norm" in name or name.endswith(("router.scale", "per_expert_scale", "layer_scalar"))
            t = torch.ones(*shape, device=device, dtype=dtype) if ones else randn(*shape, std=0.02)
        elif "embed_tokens" in name:
            t = randn(*shape, std=2.0 * h**-0.5)
        elif name.endswith("experts.gate_up_proj"):
            t = randn(*shape, std=h**-0.5)
        elif name.endswith("experts.down_proj"):
            t = randn(*shape, std=shape[-1] ** -0.5)
        elif "norm" in name or name.endswith("router.scale"):
            t = randn(*shape, std=0.3).add_(1.0)
        elif name.endswith("per_expert_scale") or name.endswith("layer_scalar"):
            t = torch.rand(*shape, generator=g, device=device, dtype=dtype).add_(0.5)
        else:  # linear [out, in]
            t = randn(*shape, std=shape[-1] ** -0.5 * (4.0 if "router.proj" in name else 1.0))
        setattr(module, attr, torch.nn.Parameter(t, requires_grad=False))
    for layer in model.layers:
        layer.encoder_layer_scalar = torch.nn.Parameter(
            layer.layer_scalar.detach().clone(), requires_grad=False
        )
    model.inv_freq = {k: v.to(device) for k, v in model.inv_freq.items()}
    return model


def load_checkpoint(path: str, device: str, dtype: torch.dtype) -> tuple[DiffusionGemma, dict[str, Any]]:
    from diffgemma.config import load_runtime_config
    from diffgemma.weights.loader import load_model

    base = load_runtime_config().overlay_base  # an overlay pack's base, as Engine.load reads it
    return load_model(path, device, dtype, base=base), json.loads((Path(path) / "config.json").read_text())


def weight_bytes(model: DiffusionGemma) -> int:
    """Bytes of the model's weights on its device: parameters and quantized weights (views counted once)."""
    from diffgemma.quant.weight import QuantWeight

    seen, total = set(), 0
    tensors = list(model.parameters())
    for m in model.modules():
        tensors += [t for w in vars(m).values() if isinstance(w, QuantWeight) for t in w.parts.values()]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def quantize_weights(model: DiffusionGemma, profile: str, sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Quantize the model's weights in place on their device, as a pack of this profile would load there
    (formats without a kernel on the device dequantized back, as the loader does). Returns the resolved spec."""
    from diffgemma.quant.formats import FormatError
    from diffgemma.quant.profiles import resolve
    from diffgemma.quant.weight import QuantWeight
    from diffgemma.weights.loader import ATTR_CLASSES, checkpoint_names, runs_quantized, set_weight

    base, fmts, given = resolve(profile, sets)
    for name, module, attr in checkpoint_names(model):
        fmt = fmts.get(ATTR_CLASSES.get(attr, ""), "bf16")
        if fmt == "bf16":
            continue
        w = getattr(module, attr)
        try:
            q = QuantWeight.quantize(w, fmt)
        except FormatError as e:
            raise ValueError(f"{name} cannot be {fmt}: {e}") from None
        set_weight(module, attr, q if runs_quantized(w.device, attr, fmt) else q.dequantize(w.dtype))
        del w, q
    for layer in model.layers:
        layer._merged.clear()
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"profile": base, "formats": fmts, "overrides": given}


def kv_bytes(cfg: ModelConfig, ctx: int, dtype: torch.dtype) -> int:
    es = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * cfg.num_kv_heads[i] * cfg.head_dims[i] * ctx * es for i in range(cfg.num_layers))
