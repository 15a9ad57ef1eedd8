"""Where and in what precision the model runs: the device and dtype a `RuntimeConfig` asks for, and CPU threads."""

from __future__ import annotations

import torch

from diffgemma.config import ModelConfig, RuntimeConfig

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Below this many weights touched a token, CPU inference runs on one thread: its ops are too small for threads to
# pay, and on a machine whose other cores are busy torch's spinning threads made the demo model's denoise step 65x
# slower (docs/performance.md, "CPU threads").
SMALL_MODEL_ACTIVE_PARAMS = 100_000_000
TORCH_THREADS = torch.get_num_threads()  # torch's own default (its physical cores), before anyone changes it


def best_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_and_dtype(config: RuntimeConfig) -> tuple[torch.device, torch.dtype]:
    """The config's device (the best available when unset) and dtype (bf16 on a GPU, fp32 on CPU when unset)."""
    device = torch.device(config.device or best_device())
    name = ALIASES.get(config.dtype, config.dtype) if config.dtype else None
    if name is None:
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; use one of {', '.join([*DTYPES, *ALIASES])}")
    return device, DTYPES[name]


def active_params(cfg: ModelConfig) -> int:
    """Weights one token's forward multiplies: attention, dense MLP, its top-k experts, router and LM head."""
    h, total = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size
    for i in range(cfg.num_layers):
        q, kv = cfg.num_heads * cfg.head_dims[i], cfg.num_kv_heads[i] * cfg.head_dims[i]
        attention = h * (2 * q + kv * (2 if cfg.is_sliding(i) else 1))
        experts = cfg.top_k_experts * 3 * h * cfg.moe_intermediate_size
        total += attention + 3 * h * cfg.intermediate_size + experts + cfg.num_experts * h
    return total


def set_cpu_threads(cfg: ModelConfig, threads: int | None = None) -> int:
    """Set torch's intra-op threads for CPU inference and return the count: `threads` when given, else one for a
    model under SMALL_MODEL_ACTIVE_PARAMS active weights and torch's default for a larger one."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if threads is None:
        threads = 1 if active_params(cfg) < SMALL_MODEL_ACTIVE_PARAMS else TORCH_THREADS
    torch.set_num_threads(threads)
    return threads
