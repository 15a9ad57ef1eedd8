"""Where and in what precision the model runs: the device and dtype a `RuntimeConfig` asks for, and CPU threads."""

from __future__ import annotations

import os

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
# OpenMP wait policy. libgomp's threads spin by default (about 300,000 polls) at every barrier before sleeping, so
# two processes of two threads on two cores each spun on a core the other needed: 2.0-2.1 tok/s each against 9.1
# alone on a 130M-active model (the 77 -> 7-9 on the demo with --threads 2). Sleeping (PASSIVE) they kept
# 5.2-5.4 each, against 7.8 alone (the cost of waking a thread at each op's barrier); one thread each gave 5.3
# alone and together. So: all cores for a large model, waiting PASSIVE, which diffgemma/__init__.py sets before
# torch loads (libgomp reads it only then); a user's own OMP_WAIT_POLICY is kept (docs/performance.md, "CPU threads").
# What torch's OpenMP was started with: None when diffgemma was imported after torch and nobody set it.
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")


def best_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(name: str) -> torch.device:
    """The device `name` names, or a ValueError saying why this torch on this machine cannot run there."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):  # torch's own message lists twenty device types we do not run on
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(
                f"device {name!r}: this torch ({torch.__version__}) is built without CUDA; use cpu, or install "
                "a CUDA build of torch"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device {name!r}: no CUDA GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES); use cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: only {count} CUDA GPU(s) visible, cuda:0 to cuda:{count - 1}")
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_built():
            raise ValueError(f"device {name!r}: this torch is built without MPS (Apple GPUs); use cpu")
        if not mps.is_available():
            raise ValueError(
                f"device {name!r}: MPS is not available on this machine (macOS 12.3+ on Apple silicon)"
            )
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported: use cpu, cuda, cuda:N or mps")
    return device


def device_and_dtype(config: RuntimeConfig) -> tuple[torch.device, torch.dtype]:
    """The config's device (the best available when unset; ValueError for one that cannot run here) and dtype
    (bf16 on a GPU, fp32 on CPU when unset)."""
    device = check_device(config.device) if config.device else torch.device(best_device())
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
