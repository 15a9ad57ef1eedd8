"""Build, initialise and save trainable DiffusionGemma models in the real checkpoint format.

The checkpoint directory is what `diffgemma.load` reads: config.json (nested text_config, real spelling),
generation_config.json, model.safetensors with the loader's tensor names (`checkpoint_names`) plus the
encoder's `layer_scalar` copies, and tokenizer.json. Training state for `--resume` (fp32 master weights and
AdamW moments) is kept in safetensors too, under `train_state/`, next to a JSON file with the step and config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from diffgemma.config import ModelConfig
from diffgemma.model.model import DiffusionGemma
from diffgemma.weights.loader import ENCODER, checkpoint_names

SLIDING, FULL = "sliding_attention", "full_attention"


def text_config(
    vocab_size: int,
    hidden_size: int = 256,
    intermediate_size: int = 384,
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL),
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    global_head_dim: int = 128,
    num_global_key_value_heads: int = 1,
    sliding_window: int = 128,
    num_experts: int = 8,
    top_k_experts: int = 2,
    moe_intermediate_size: int = 128,
) -> dict[str, Any]:
    """A text_config in the real checkpoint's spelling (global_head_dim, num_global_key_value_heads)."""
    return {
        "model_type": "diffusion_gemma_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": num_global_key_value_heads,
        "attention_k_eq_v": True,
        "sliding_window": sliding_window,
        "layer_types": list(layer_types),
        "num_experts": num_experts,
        "top_k_experts": top_k_experts,
        "moe_intermediate_size": moe_intermediate_size,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "rope_parameters": {
            FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }


def full_config(tc: dict[str, Any], canvas_length: int) -> dict[str, Any]:
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": canvas_length,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "text_config": tc,
    }


def generation_config(max_denoising_steps: int = 16, max_new_tokens: int = 256) -> dict[str, Any]:
    return {
        "max_denoising_steps": max_denoising_steps,
        "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
        "max_new_tokens": max_new_tokens,
        "bos_token_id": 2,
        "pad_token_id": 0,
        "eos_token_id": [1, 106, 50],
    }


FROZEN = ("layer_scalar", "encoder_layer_scalar")  # buffers in the real model; kept at 1.0


def build_model(config: dict[str, Any], seed: int, device: str | torch.device = "cpu") -> DiffusionGemma:
    """A freshly initialised, trainable fp32 model (every parameter but the layer scalars requires grad)."""
    cfg = ModelConfig.from_dict(config)
    model = DiffusionGemma(cfg)
    init_weights(model, seed)
    return make_trainable(model.to(device))


def make_trainable(model: DiffusionGemma) -> DiffusionGemma:
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1] not in FROZEN)
    for lt in model.inv_freq:
        model.inv_freq[lt] = model.inv_freq[lt].to(model.device)
    return model


@torch.no_grad()
def grow_vocab(
    model: DiffusionGemma, config: dict[str, Any], old: Tokenizer, new: Tokenizer
) -> tuple[DiffusionGemma, dict[str, Any]]:
    """`model` and its config with the vocabulary grown to hold `new` (rows to a multiple of 64), when `new`
    extends `old`. A new token's row copies its spaced twin's ("Ġ" + token) where `old` has one, as a word in a
    JSON string means what it means after a space; else the mean of the rows of its pieces under `old`. Rows no
    token uses are random at the trained rows' scale."""
    rows = -(-new.get_vocab_size() // 64) * 64
    if rows <= model.cfg.vocab_size:
        return model, config
    # rows no token uses drawn at the trained rows' scale: the trainer's noise draws every id, and a zero row's
    # norm has a huge gradient
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(rows, model.cfg.hidden_size, generator=g).to(model.embed) * model.embed.std()
    embed[: model.cfg.vocab_size] = model.embed
    known = old.get_vocab()
    for text, i in new.get_vocab().items():
        if text in known:
            continue
        twin = old.token_to_id("Ġ" + text)
        pieces = [twin] if twin is not None else old.encode(new.decode([i]), add_special_tokens=False).ids
        embed[i] = model.embed[pieces].mean(0)
    config = json.loads(json.dumps(config))
    config.get("text_config", config)["vocab_size"] = rows
    grown = DiffusionGemma(ModelConfig.from_dict(config)).to(model.embed.device)
    state = model.state_dict()
    state["embed"] = embed
    grown.load_state_dict(state)
    return make_trainable(grown), config


@torch.no_grad()
def init_weights(model: DiffusionGemma, seed: int) -> None:
    """Gemma-style init: N(0, fan_in^-1/2) matrices, the residual-side projections and the SC MLP's output
    scaled down, every norm weight 1 (Gemma 4's RMSNorm multiplies by w, not 1 + w), scalars 1."""
    g = torch.Generator().manual_seed(seed)
    h = model.cfg.hidden_size

    def normal_(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * std)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 1:
            p.fill_(1.0)
        elif leaf == "embed":
            normal_(p, h**-0.5)
        elif leaf == "router_proj":
            normal_(p, 0.02)
        elif leaf == "experts_gate_up":
            normal_(p, p.shape[-1] ** -0.5)
        elif leaf == "experts_down":
            normal_(p, p.shape[-1] ** -0.5 / math.sqrt(2 * model.cfg.num_layers))
        elif leaf in ("o_proj", "mlp_down"):
            normal_(p, p.shape[1] ** -0.5 / math.sqrt(2 * model.cfg.num_layers))
        elif leaf == "sc_down":
            normal_(p, 0.1 * p.shape[1] ** -0.5)
        else:
            normal_(p, p.shape[1] ** -0.5)


def state_tensors(model: DiffusionGemma, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, the loader's names plus the encoder layer_scalar copies."""
    out = {}
    for name, owner, attr in checkpoint_names(model):
        out[name] = getattr(owner, attr).detach().to("cpu", dtype).contiguous()
    for i, layer in enumerate(model.layers):
        out[f"{ENCODER}layers.{i}.layer_scalar"] = (
            layer.encoder_layer_scalar.detach().to("cpu", dtype).reshape(1)
        )
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None = None) -> None:
    """model.safetensors, or shards + model.safetensors.index.json when over max_shard_bytes."""
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for s, part in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def merge_shards(path: str | Path) -> None:
    """Rewrite a sharded checkpoint directory as a single model.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    save_tensors(tensors, path)


def write_checkpoint(
    model: DiffusionGemma,
    out: str | Path,
    config: dict[str, Any],
    gen_config: dict[str, Any],
    tokenizer=None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    save_tensors(state_tensors(model, dtype), out, max_shard_bytes)
    if tokenizer is not None:
        from diffgemma.testing.tokenizer import write_tokenizer_files

        write_tokenizer_files(out, tokenizer)
    return out


# -- resumable training state ---------------------------------------------------------------------


def save_train_state(
    out: Path, model: DiffusionGemma, opt: torch.optim.Optimizer, info: dict[str, Any]
) -> None:
    d = out / "train_state"
    d.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"param/{n}": p.detach().float().cpu().contiguous() for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"{key}/{names[id(p)]}"] = st[key].detach().float().cpu().contiguous()
            if "step" in st:
                info.setdefault("adam_step", float(st["step"]))
    tmp = d / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(d / "state.safetensors")
    (d / "state.json").write_text(json.dumps(info, indent=2) + "\n")


def load_train_state(out: Path, model: DiffusionGemma, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    d = out / "train_state"
    if not (d / "state.json").exists():
        return None
    info = json.loads((d / "state.json").read_text())
    tensors = load_file(str(d / "state.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"param/{n}"].to(p.device, p.dtype))
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            if f"exp_avg/{n}" in tensors:
                opt.state[p] = {
                    "step": torch.tensor(
                        info.get("adam_step", info["step"]),
                        dtype=torch.float32,
                        device=p.device if group.get("capturable") else "cpu",
                    ),
                    "exp_avg": tensors[f"exp_avg/{n}"].to(p.device),
                    "exp_avg_sq": tensors[f"exp_avg_sq/{n}"].to(p.device),
                }
    return info
