"""`Engine`: a loaded model, its sampler config and a KV cache, behind `generate`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffgemma.chat.parser import parse_reply
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.config import LOAD_CONTEXT, ModelConfig, SamplerConfig, env_str, load_sampler_config
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


Prompt = list[int] | torch.Tensor | str | list[dict[str, Any]]

# Below this many weights touched a token, CPU inference runs on one thread: its ops are too small for threads
# to pay, and on a machine whose other cores are busy torch's spinning threads made the demo model's denoise step
# 65x slower (docs/performance.md, "CPU threads").
SMALL_MODEL_ACTIVE_PARAMS = 100_000_000
_TORCH_THREADS = torch.get_num_threads()  # torch's own default (its physical cores), before anyone changes it


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
        threads = 1 if active_params(cfg) < SMALL_MODEL_ACTIVE_PARAMS else _TORCH_THREADS
    torch.set_num_threads(threads)
    return threads


class Engine:
    def __init__(
        self,
        model: DiffusionGemma,
        sampler: SamplerConfig,
        path: Path | None = None,
        max_tokens: int = 8192,
        tokenizer: ChatTokenizer | None = None,
    ):
        self.model = model
        self.sampler = sampler
        self.path = path
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        # The cache of calls without `kv`, reset and reused while big enough: the model's captured denoise
        # graphs are tied to a cache, so a fresh one per call would capture them again each time.
        self._kv: KVCache | None = None

    def prompt_ids(
        self,
        prompt: Prompt,
        *,
        think: bool = False,
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
    ) -> list[int]:
        """Token ids for a prompt: ids as given; a string as one user message (or verbatim with `raw`);
        an OpenAI-style message list rendered with the chat template."""
        if isinstance(prompt, torch.Tensor):
            return prompt.reshape(-1).tolist()
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        tok = self._need_tokenizer()
        if isinstance(prompt, str):
            if raw:
                return tok.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise TypeError("prompt must be token ids, a string, or a list of message dicts")
        return tok.encode_chat(prompt, tools=tools, add_generation_prompt=True, enable_thinking=think)

    def _need_tokenizer(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path or 'this model'} has no tokenizer.json: pass token ids")
        return self.tokenizer

    def parse(self, out: GenerateOutput) -> GenerateOutput:
        """Fill out.text / reasoning / tool_calls from the generated ids."""
        if self.tokenizer is not None:
            out.text, out.reasoning, out.tool_calls = parse_reply(self.tokenizer, out.token_ids)
        return out

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return self.model.new_cache(max_tokens or self.max_tokens)

    def _one_shot_cache(self, need: int) -> KVCache:
        """The engine's own cache, emptied, with room for `need` tokens (allocated anew only to grow)."""
        size = max(self.max_tokens, need)
        if self._kv is None or self._kv.max_tokens < size or self._kv.device != self.model.device:
            self._kv = None  # free the old one before allocating its successor
            self._kv = self.new_cache(size)
        self._kv.reset()
        return self._kv

    def warm_up(self) -> float:
        """Compile the fused fast path (torch.compile'd regions and Triton kernels, once a process) by generating
        throwaway replies on caches of their own: a short prompt (prefilled under the sampler's fp32 rule when it
        is on) and one just past that rule's length (prefilled in the model's dtype), two blocks of three steps
        each, so that the denoise step with each self-conditioning input and a block's commit run too. Then the
        graphs tied to those caches are dropped. A server calls it before it takes requests, as vLLM compiles
        and captures before serving: otherwise the first reply waits for it (on an H200 a 200-token prompt's
        first reply took 5.4 s against 1.0 for a repeat, 21 s on a fresh machine: bench/results/session23/).
        Returns the seconds taken; 0.0 off the fused path, where nothing is compiled."""
        model = self.model
        if not model.is_fused:
            return 0.0
        t0 = time.perf_counter()
        canvas, vocab = self.config.canvas_length, self.config.vocab_size
        sampler = self.sampler.replace(max_denoising_steps=3, stop_token_ids=(), empty_reply_retry=0)
        f32_max = sampler.prefill_f32_max_tokens
        for n in (min(8, f32_max), f32_max + 1) if f32_max else (8,):
            ids = [3 + i % (vocab - 3) for i in range(n)]  # past pad, eos and bos
            kv = model.new_cache(n + 3 * canvas)
            generate(model, ids, kv, sampler, seed=0, max_new_tokens=2 * canvas)
            del kv
        model.release_graphs()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
            torch.cuda.empty_cache()  # the graphs' pool back to the device, for the memory a server plans
        return time.perf_counter() - t0

    def generate(
        self,
        prompt_ids: Prompt,
        max_new_tokens: int | None = None,
        seed: int = 42,
        on_step: Callable[[StepInfo], None] | None = None,
        on_block: Callable[[list[int]], None] | None = None,
        *,
        kv: KVCache | None = None,
        cancel: CancelToken | None = None,
        sampler: SamplerConfig | None = None,
        think: bool = False,
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
        logprobs: int | None = None,
        **sampler_overrides: Any,
    ) -> GenerateOutput:
        """Generate a reply. The prompt is token ids, a string (one user turn) or an OpenAI-style message list;
        with a tokenizer, out.text / out.reasoning / out.tool_calls are set. With `kv`, the prompt is the tokens
        not yet cached and the cache is extended in place (multi-turn reuse); without it the engine's own cache is
        emptied and used (one generation at a time per engine)."""
        prompt_ids = self.prompt_ids(prompt_ids, think=think, tools=tools, raw=raw)
        cfg = sampler or self.sampler
        if sampler_overrides:
            cfg = dataclasses.replace(cfg, **sampler_overrides).validated()
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        if kv is None:
            kv = self._one_shot_cache(len(prompt_ids) + max_new + self.config.canvas_length)
        elif kv.length + len(prompt_ids) >= kv.max_tokens:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context ({kv.length}/{kv.max_tokens} used)"
            )
        if not prompt_ids and kv.length == 0:
            raise ValueError("empty prompt: there is nothing to condition on")
        # Like any engine with a fixed context: the reply stops at the context's end ("length").
        max_new = min(max_new, kv.max_tokens - kv.length - len(prompt_ids))
        out = generate(
            self.model, list(prompt_ids), kv, cfg, seed, max_new, on_step, on_block, cancel, logprobs
        )
        return self.parse(out)


def load(
    path: str | Path,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_tokens: int | None = None,
    threads: int | None = None,
    **sampler_overrides: Any,
) -> Engine:
    """Load a checkpoint directory. device/dtype default to the best available (cuda/mps bf16, cpu fp32);
    `max_tokens` is the context (prompt + reply), at most the model's max_position_embeddings. On CPU, torch's
    threads are set by `set_cpu_threads` (`threads` overrides its choice)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    device = device or env_str("DEVICE") or best_device()
    torch_dtype = resolve_dtype(dtype or env_str("DTYPE"), torch.device(device).type)
    cfg = ModelConfig.from_dir(path)
    max_tokens = cfg.context(max_tokens, LOAD_CONTEXT)
    if torch.device(device).type == "cpu":
        set_cpu_threads(cfg, threads)
    model = load_model(path, device, torch_dtype)
    sampler = load_sampler_config(path)
    if sampler_overrides:
        sampler = dataclasses.replace(sampler, **sampler_overrides).validated()
    tokenizer = ChatTokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Engine(model, sampler, path, max_tokens=max_tokens, tokenizer=tokenizer)
