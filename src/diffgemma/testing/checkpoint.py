"""Tiny DiffusionGemma checkpoints in the real on-disk format, written by our own code.

config.json (nested `text_config`, real or transformers spelling), generation_config.json, model.safetensors
(or shards + index) with the real tensor names, and a small byte-level BPE tokenizer.json that holds the
Gemma 4 special tokens at their real ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "sliding_window": 8,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "model_type": "diffusion_gemma_text",
}
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
GENERATION_CONFIG: dict[str, Any] = {
    "max_denoising_steps": 48,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "max_new_tokens": 256,
    "bos_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": [1, 106, 50],
}


def _text_config(config_style: str, overrides: dict[str, Any]) -> dict[str, Any]:
    tc = {**TINY_TEXT_CONFIG, **overrides}
    if config_style == "transformers":  # per_layer_config instead of the global_* keys
        g_hd, g_kv = tc.pop("global_head_dim"), tc.pop("num_global_key_value_heads")
        tc["per_layer_config"] = {
            str(i): {"head_dim": g_hd, "num_key_value_heads": g_kv}
            for i, t in enumerate(tc["layer_types"])
            if t == "full_attention"
        }
    elif config_style != "real":
        raise ValueError(f"config_style must be 'real' or 'transformers', got {config_style!r}")
    return tc


def random_tensors(tc: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights with non-trivial norms, scales and layer scalars."""
    g = torch.Generator().manual_seed(seed)
    h, inter, moe_i = tc["hidden_size"], tc["intermediate_size"], tc["moe_intermediate_size"]
    n_exp, n_heads = tc["num_experts"], tc["num_attention_heads"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * in_f**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(n, generator=g)

    def uniform(*shape: int, lo: float = 0.5, hi: float = 1.5) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    p = "model.decoder."
    t: dict[str, torch.Tensor] = {
        p + "embed_tokens.weight": torch.randn(tc["vocab_size"], h, generator=g) * 2.0 * h**-0.5,
        p + "norm.weight": norm(h),
        p + "self_conditioning.pre_norm.weight": norm(h),
        p + "self_conditioning.gate_proj.weight": linear(inter, h),
        p + "self_conditioning.up_proj.weight": linear(inter, h),
        p + "self_conditioning.down_proj.weight": linear(h, inter),
    }
    for i, lt in enumerate(tc["layer_types"]):
        full = lt == "full_attention"
        if full:
            hd = (
                tc["per_layer_config"][str(i)]["head_dim"]
                if "per_layer_config" in tc
                else tc["global_head_dim"]
            )
            kv = (
                tc["per_layer_config"][str(i)]["num_key_value_heads"]
                if "per_layer_config" in tc
                else tc["num_global_key_value_heads"]
            )
        else:
            hd, kv = tc["head_dim"], tc["num_key_value_heads"]
        q = f"{p}layers.{i}."
        t[q + "self_attn.q_proj.weight"] = linear(n_heads * hd, h)
        t[q + "self_attn.k_proj.weight"] = linear(kv * hd, h)
        if not full:
            t[q + "self_attn.v_proj.weight"] = linear(kv * hd, h)
        t[q + "self_attn.o_proj.weight"] = linear(h, n_heads * hd)
        t[q + "self_attn.q_norm.weight"] = norm(hd)
        t[q + "self_attn.k_norm.weight"] = norm(hd)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        ):
            t[q + name + ".weight"] = norm(h)
        t[q + "mlp.gate_proj.weight"] = linear(inter, h)
        t[q + "mlp.up_proj.weight"] = linear(inter, h)
        t[q + "mlp.down_proj.weight"] = linear(h, inter)
        t[q + "router.proj.weight"] = linear(n_exp, h) * 4.0
        t[q + "router.scale"] = norm(h)
        t[q + "router.per_expert_scale"] = uniform(n_exp)
        t[q + "experts.gate_up_proj"] = torch.randn(n_exp, 2 * moe_i, h, generator=g) * h**-0.5
        t[q + "experts.down_proj"] = torch.randn(n_exp, h, moe_i, generator=g) * moe_i**-0.5
        t[q + "layer_scalar"] = uniform(1)
        t[f"model.encoder.language_model.layers.{i}.layer_scalar"] = t[q + "layer_scalar"].clone()
    return {k: v.contiguous() for k, v in t.items()}


def write_tiny_checkpoint(
    path: str | Path,
    seed: int = 0,
    *,
    config_style: str = "real",
    shards: int = 1,
    canvas_length: int = 16,
    generation: dict[str, Any] | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint directory; `overrides` replace text_config keys. Returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tc = _text_config(config_style, overrides)
    config = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": canvas_length,
        "tie_word_embeddings": True,
        "text_config": tc,
        "vision_config": TINY_VISION_CONFIG,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({**GENERATION_CONFIG, **(generation or {})}, indent=2)
    )

    tensors = random_tensors(tc, seed)
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(tensors)
        weight_map: dict[str, str] = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    if tokenizer:
        from diffgemma.testing.tokenizer import build_tokenizer, write_tokenizer_files

        write_tokenizer_files(path, build_tokenizer(vocab_size=min(tc["vocab_size"], 1024)))
    return path
