"""The shapes bench measures: the real 26B-A4B config, a tiny one of the same structure, the contexts."""

from __future__ import annotations

from typing import Any

GIB = 1024**3
CONTEXTS = "1024,8192,32768,131072"
TINY_CONTEXTS = "256,1024"  # --tiny's default: what a CPU finishes in seconds


# The real checkpoint's config.json spelling (google/diffusiongemma-26B-A4B-it); the vision tower is the
# tiny test one (text benchmarks never run it, and transformers must still build one).
REAL_CONFIG: dict[str, Any] = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "diffusion_gemma_text",
        "vocab_size": 262144,
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "enable_moe_block": True,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262144,
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
    },
    "vision_config": {
        "model_type": "gemma4_vision",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
    },
}


def tiny_config() -> dict[str, Any]:
    """A small config with the same structure, for running the bench's code paths on CPU."""
    from diffgemma.testing.checkpoint import TINY_TEXT_CONFIG, TINY_VISION_CONFIG

    tc = dict(TINY_TEXT_CONFIG, sliding_window=16, moe_intermediate_size=32)  # every format's dimension rule
    return {**REAL_CONFIG, "canvas_length": 32, "text_config": tc, "vision_config": TINY_VISION_CONFIG}
