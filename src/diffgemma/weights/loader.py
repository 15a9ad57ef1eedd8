"""Load a DiffusionGemma checkpoint (single or sharded safetensors, memory-mapped) into our model.

Safetensors only: nothing from a checkpoint is ever unpickled. Every weight must be floating-point and finite
(checked on the device as it lands); float16 weights are converted to the model's dtype, with a line saying so.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffgemma.config import ModelConfig
from diffgemma.model.model import DiffusionGemma

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
IGNORED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

LAYER_NAMES = {  # checkpoint suffix under layers.N. -> our Layer attribute
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    "post_feedforward_layernorm_1.weight": "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2.weight": "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2.weight": "post_feedforward_layernorm_2",
    "mlp.gate_proj.weight": "mlp_gate",
    "mlp.up_proj.weight": "mlp_up",
    "mlp.down_proj.weight": "mlp_down",
    "router.proj.weight": "router_proj",
    "router.scale": "router_scale",
    "router.per_expert_scale": "per_expert_scale",
    "experts.gate_up_proj": "experts_gate_up",
    "experts.down_proj": "experts_down",
    "layer_scalar": "layer_scalar",
}
TOP_NAMES = {
    "embed_tokens.weight": "embed",
    "norm.weight": "norm",
    "self_conditioning.pre_norm.weight": "sc_pre_norm",
    "self_conditioning.gate_proj.weight": "sc_gate",
    "self_conditioning.up_proj.weight": "sc_up",
    "self_conditioning.down_proj.weight": "sc_down",
}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, misshapen or corrupt."""


def checkpoint_names(model: DiffusionGemma) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """(checkpoint tensor name, owning module, attribute) for every weight the model needs."""
    for suffix, attr in TOP_NAMES.items():
        yield DECODER + suffix, model, attr
    if model.lm_head is not None:
        yield "lm_head.weight", model, "lm_head"
    for i, layer in enumerate(model.layers):
        for suffix, attr in LAYER_NAMES.items():
            if getattr(layer, attr) is not None:
                yield f"{DECODER}layers.{i}.{suffix}", layer, attr


def _set(module: torch.nn.Module, attr: str, t: torch.Tensor) -> None:
    setattr(module, attr, torch.nn.Parameter(t, requires_grad=False))


def shard_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"{f} is listed in {index.name} but missing")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: corrupt safetensors file ({e})") from None


def load_weights(
    model: DiffusionGemma, path: str | Path, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Fill every parameter of `model` from the checkpoint at `path`, cast to dtype on device."""
    path = Path(path)
    files = shard_files(path)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in set(files.values())}

        def read(name: str) -> torch.Tensor:
            try:
                return handles[files[name]].get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"tensor {name}: corrupt data in {files[name].name} ({e})") from None

        target = str(dtype).removeprefix("torch.")
        said: set[torch.dtype] = set()

        def land(name: str, t: torch.Tensor) -> torch.Tensor:
            """`t` on the device in the model's dtype, refused unless floating-point and finite."""
            if not t.dtype.is_floating_point:
                raise CheckpointError(f"tensor {name} is {t.dtype}, not a floating-point type")
            if t.dtype == torch.float16 != dtype and not said:
                said.add(t.dtype)
                print(
                    f"diffgemma: the checkpoint's weights are float16; converting them to {target}",
                    file=sys.stderr,
                )
            out = t.to(device=device, dtype=dtype)
            if not bool(torch.isfinite(out).all()):
                cast = f" once cast to {target}" if t.dtype != dtype and bool(torch.isfinite(t).all()) else ""
                raise CheckpointError(f"tensor {name} holds NaN or infinite values{cast}")
            return out

        used = set()
        for name, owner, attr in checkpoint_names(model):
            param = getattr(owner, attr)
            if name not in files:
                raise CheckpointError(f"tensor {name} is missing from the checkpoint at {path}")
            t = read(name)
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(t.shape)}, the config expects {tuple(param.shape)}"
                )
            _set(owner, attr, land(name, t))
            used.add(name)
        for i, layer in enumerate(model.layers):
            name = f"{ENCODER}layers.{i}.layer_scalar"
            if name in files:
                t = read(name)
                if t.numel() != 1:
                    raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, expected (1,)")
                _set(layer, "encoder_layer_scalar", land(name, t.reshape(1)))
                used.add(name)
            else:  # the encoder shares the decoder's weights
                _set(layer, "encoder_layer_scalar", layer.layer_scalar.detach().clone())
        unknown = [
            n
            for n in files
            if n not in used
            and not n.startswith(IGNORED_PREFIXES)
            and not n.startswith(ENCODER)
            and n != "lm_head.weight"
        ]
        if unknown:
            print(f"diffgemma: ignoring {len(unknown)} unknown tensors, e.g. {unknown[0]}", file=sys.stderr)
    for lt in model.inv_freq:
        model.inv_freq[lt] = model.inv_freq[lt].to(device)


def load_model(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> DiffusionGemma:
    """Build the model from config.json without allocating (meta device), then fill it from the checkpoint."""
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    load_weights(model, path, device, dtype)
    return model.eval()
