"""`Engine`: a loaded model, its sampler config and a KV cache, behind `generate`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffgemma.config import ModelConfig, SamplerConfig, env_str, load_sampler_config
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo, generate
from diffgemma.model.kv_cache import KVCache
from diffgemma.model.model import DiffusionGemma
from diffgemma.weights.loader import load_model

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def best_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Engine:
    def __init__(
        self, model: DiffusionGemma, sampler: SamplerConfig, path: Path | None = None, max_tokens: int = 8192
    ):
        self.model = model
        self.sampler = sampler
        self.path = path
        self.max_tokens = max_tokens

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return self.model.new_cache(max_tokens or self.max_tokens)

    def generate(
        self,
        prompt_ids: list[int] | torch.Tensor,
        max_new_tokens: int | None = None,
        seed: int = 42,
        on_step: Callable[[StepInfo], None] | None = None,
        on_block: Callable[[list[int]], None] | None = None,
        *,
        kv: KVCache | None = None,
        cancel: CancelToken | None = None,
        sampler: SamplerConfig | None = None,
        **sampler_overrides: Any,
    ) -> GenerateOutput:
        """Generate a reply to `prompt_ids`. With `kv`, the ids are the tokens not yet cached and the cache is
        extended in place (multi-turn reuse); without it a fresh cache is used."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        cfg = sampler or self.sampler
        if sampler_overrides:
            cfg = dataclasses.replace(cfg, **sampler_overrides).validated()
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        if kv is None:
            need = len(prompt_ids) + max_new + self.config.canvas_length
            kv = self.new_cache(max(self.max_tokens, need))
        elif kv.length + len(prompt_ids) > kv.max_tokens:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the cache ({kv.length}/{kv.max_tokens} used)"
            )
        if not prompt_ids and kv.length == 0:
            raise ValueError("empty prompt: there is nothing to condition on")
        return generate(self.model, list(prompt_ids), kv, cfg, seed, max_new, on_step, on_block, cancel)


def load(
    path: str | Path,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_tokens: int = 8192,
    **sampler_overrides: Any,
) -> Engine:
    """Load a checkpoint directory. device/dtype default to the best available (cuda/mps bf16, cpu fp32)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    device = device or env_str("DEVICE") or best_device()
    torch_dtype = resolve_dtype(dtype or env_str("DTYPE"), torch.device(device).type)
    model = load_model(path, device, torch_dtype)
    sampler = load_sampler_config(path)
    if sampler_overrides:
        sampler = dataclasses.replace(sampler, **sampler_overrides).validated()
    return Engine(model, sampler, path, max_tokens=max_tokens)
