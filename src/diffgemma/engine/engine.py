"""`Engine`: a loaded model, its runner, sampler config and tokenizer, behind `generate`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo, Turn, drive
from diffgemma.engine.warm_up import warm_up
from diffgemma.model.kv_cache import KVCache
from diffgemma.model.model import DiffusionGemma
from diffgemma.runner.devices import device_and_dtype, set_cpu_threads
from diffgemma.runner.runner import ModelRunner
from diffgemma.weights.loader import load_model

Prompt = list[int] | torch.Tensor | str | list[dict[str, Any]]


class ContextOverflow(ValueError):
    """A prompt (or canvas) that does not fit what the context leaves: the request's size, not the server's state."""


def _check_int(name: str, value: Any, minimum: int | None = None, optional: bool = False) -> None:
    """TypeError unless `value` is an int (None too when `optional`), ValueError when it is below `minimum`."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


class Engine:
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
        # The conversation of calls without `kv` (the token pipeline's, emptied each call and reused: the runner's
        # captured denoise graphs are tied to a cache, so a fresh one per call would capture them again each time)
        self._oneshot = None
        self._scorer = None  # `score`'s conversation

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
        return self.runner.new_cache(max_tokens or self.max_tokens)

    def warm_up(self) -> float:
        """Compile and capture the fast path before the first request (`engine.warm_up`); seconds taken."""
        return warm_up(self.runner, self.sampler)

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
        not yet cached and the cache is extended in place (multi-turn reuse); without it the call is ops on a
        conversation of the engine's own, emptied first (one generation at a time per engine)."""
        _check_int("max_new_tokens", max_new_tokens, minimum=1, optional=True)
        _check_int("seed", seed)
        _check_int("logprobs", logprobs, minimum=0, optional=True)
        if sampler is not None and not isinstance(sampler, SamplerConfig):
            raise TypeError(f"sampler must be a SamplerConfig, got {type(sampler).__name__}")
        prompt_ids = self.prompt_ids(prompt_ids, think=think, tools=tools, raw=raw)
        cfg = sampler or self.sampler
        if sampler_overrides:
            cfg = dataclasses.replace(cfg, **sampler_overrides).validated()
        if kv is None:  # a conversation of the token pipeline's, emptied: the call goes through its ops
            from diffgemma.session.client import Session

            if self._oneshot is None:
                self._oneshot = Session(self)
            self._oneshot.reset()
            return self._oneshot.generate(
                prompt_ids,
                max_new_tokens,
                seed,
                on_step,
                on_block,
                cancel=cancel,
                logprobs=logprobs,
                sampler=cfg,
            )
        turn = self.turn(prompt_ids, kv, cfg, seed, max_new_tokens, logprobs)
        on_commit = None if on_block is None else lambda _turn, kept: on_block(kept)
        return self.parse(drive(turn, on_step, cancel, on_commit))

    def score(self, schema: dict[str, Any], state: Any, seed: int = 42) -> dict[str, Any]:
        """Answer a question schema about `state` by scored reads (`diffgemma.Session.score`, on a conversation the
        engine keeps, so that the schema's prefix is reused by the next state)."""
        from diffgemma.session.client import Session

        if not isinstance(schema, dict):  # a JSON string given as is would fail deep inside, on schema.get
            hint = ": parse it first (json.loads)" if isinstance(schema, (str, bytes)) else ""
            raise TypeError(f"schema must be a dict (a question schema), got {type(schema).__name__}{hint}")
        _check_int("seed", seed)
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"state must be JSON-serializable (it is sent as JSON): {e}") from None
        if self._scorer is None:
            self._scorer = Session(self)
        return self._scorer.score(schema, state, seed)

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


def load(
    path: str | Path,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_tokens: int | None = None,
    threads: int | None = None,
    runtime: RuntimeConfig | None = None,
    **sampler_overrides: Any,
) -> Engine:
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
    _check_int("max_tokens", max_tokens, minimum=1, optional=True)
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
    model = load_model(path, torch_device, torch_dtype)
    sampler = load_sampler_config(path)
    if sampler_overrides:
        sampler = dataclasses.replace(sampler, **sampler_overrides).validated()
    tokenizer = ChatTokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Engine(ModelRunner(model, config), sampler, path, max_tokens=max_tokens, tokenizer=tokenizer)
