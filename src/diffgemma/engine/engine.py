"""`EngineCore`: a loaded model, its runner, sampler config and tokenizer, and the turns it opens. The one-shot
calls a user makes (`generate`, `score`) are the token pipeline's clients, above it: `session.client.Engine`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Self

import torch

from diffgemma.chat.parser import parse_reply
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.config import (
    LOAD_CONTEXT,
    ModelConfig,
    RuntimeConfig,
    SamplerConfig,
    load_runtime_config,
    load_sampler_config,
)
from diffgemma.config_fields import check_int
from diffgemma.engine.generate import GenerateOutput, Turn
from diffgemma.engine.warm_up import warm_up
from diffgemma.model.kv_cache import KVCache
from diffgemma.model.model import DiffusionGemma
from diffgemma.runner.devices import device_and_dtype, set_cpu_threads
from diffgemma.runner.runner import ModelRunner
from diffgemma.weights.loader import load_model

Prompt = list[int] | torch.Tensor | str | list[dict[str, Any]]


class ContextOverflow(ValueError):
    """A prompt (or canvas) that does not fit what the context leaves: the request's size, not the server's state."""


class EngineCore:
    """The engine layer's object: the model and its runner, the sampler config, the tokenizer (`prompt_ids`,
    `parse`), the turns (`turn`) that the token pipeline and the scheduler drive, and `warm_up`."""

    def __init__(
        self,
        runner: ModelRunner | DiffusionGemma,
        sampler: SamplerConfig,
        path: Path | None = None,
        max_tokens: int = LOAD_CONTEXT,
        tokenizer: ChatTokenizer | None = None,
    ):
        self.runner = runner if isinstance(runner, ModelRunner) else ModelRunner(runner)
        self.model = self.runner.model
        self.sampler = sampler
        self.path = path
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer

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
            vocab = self.model.cfg.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:  # else an IndexError deep in the embedding
                raise ValueError(f"token id {bad} is outside this model's vocabulary (0 to {vocab - 1})")
            return list(prompt)
        tok = self.need_tokenizer()
        if isinstance(prompt, str):
            if raw:
                return tok.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise TypeError("prompt must be token ids, a string, or a list of message dicts")
        return tok.encode_chat(prompt, tools=tools, add_generation_prompt=True, enable_thinking=think)

    def need_tokenizer(self) -> ChatTokenizer:
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
        return self.runner.new_cache(max_tokens or self.max_tokens)

    def warm_up(self) -> float:
        """Compile and capture the fast path before the first request (`engine.warm_up`); seconds taken."""
        return warm_up(self.runner, self.sampler)

    def turn(
        self,
        prompt_ids: list[int],
        kv: KVCache,
        cfg: SamplerConfig | None = None,
        seed: int = 42,
        max_new_tokens: int | None = None,
        logprobs: int | None = None,
        prefill_now: bool = True,
    ) -> Turn:
        """A reply to open after `kv` (`Turn`), prompt_ids prefilled first (now, or with `prefill_now=False` by the
        scheduler, a budget of tokens a step); refuses a prompt that does not fit."""
        cfg = cfg or self.sampler
        if kv.length + len(prompt_ids) >= kv.max_tokens:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens does not fit the context ({kv.length}/{kv.max_tokens} used)"
            )
        if not prompt_ids and kv.length == 0:
            raise ValueError("empty prompt: there is nothing to condition on")
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        # Like any engine with a fixed context: the reply stops at the context's end ("length").
        max_new = min(max_new, kv.max_tokens - kv.length - len(prompt_ids))
        return Turn(self.runner, list(prompt_ids), kv, cfg, seed, max_new, logprobs, prefill_now)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        max_tokens: int | None = None,
        threads: int | None = None,
        runtime: RuntimeConfig | None = None,
        **sampler_overrides: Any,
    ) -> Self:
        """Load a checkpoint directory and set up its runner. `runtime` says how the model runs (device, dtype,
        kernels, compile, graphs; without it, the `DIFFGEMMA_*` variables and the defaults), and device, dtype and
        threads given here win over it: by default the best device, bf16 on a GPU and fp32 on CPU, and on CPU torch's threads
        set by `runner.devices.set_cpu_threads`. `max_tokens` is the context (prompt + reply), at most the model's
        max_position_embeddings."""
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a model directory (str or Path), got {type(path).__name__}")
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"model path {path} is not a directory")
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        check_int("max_tokens", max_tokens, minimum=1, optional=True)
        if runtime is not None and not isinstance(runtime, RuntimeConfig):
            raise TypeError(f"runtime must be a RuntimeConfig, got {type(runtime).__name__}")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        given = {k: v for k, v in dict(device=device, dtype=dtype, threads=threads).items() if v is not None}
        config = (runtime or load_runtime_config()).replace(**given)
        torch_device, torch_dtype = device_and_dtype(config)
        cfg = ModelConfig.from_dir(path)
        max_tokens = cfg.context(max_tokens, LOAD_CONTEXT)
        if torch_device.type == "cpu":
            set_cpu_threads(cfg, config.threads)
        model = load_model(path, torch_device, torch_dtype, base=config.overlay_base)
        sampler = load_sampler_config(path)
        if sampler_overrides:
            sampler = dataclasses.replace(sampler, **sampler_overrides).validated()
        tokenizer = ChatTokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
        return cls(ModelRunner(model, config), sampler, path, max_tokens=max_tokens, tokenizer=tokenizer)
