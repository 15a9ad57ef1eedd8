"""`Session`: a conversation driven through the token pipeline, the way `ask`, `chat` and Python code reach the
model: each call is ops (AlignTo, Generate) on one pipeline, journaled when a log path is given. `Engine`, what
`diffgemma.load` returns: the engine layer's `EngineCore` with its one-shot `generate` and `score` built on
sessions of its own, so every front end reaches the model through the same pipeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.config import LOAD_CONTEXT, SamplerConfig
from diffgemma.config_fields import check_int
from diffgemma.engine.engine import ContextOverflow, EngineCore, Prompt
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session import ops as O
from diffgemma.session import scoring
from diffgemma.session.oplog import OpLog
from diffgemma.session.pipeline import Pipeline, call, sampler_fields
from diffgemma.session.stage import Stage
from diffgemma.session.tools import ToolRepair, ToolValidator

if TYPE_CHECKING:
    from diffgemma.model.model import DiffusionGemma
    from diffgemma.runner.runner import ModelRunner


def stages(pipeline: Pipeline, log: str | Path | None, tool_validate: bool, tool_repair: bool) -> Stage:
    """The pipeline with its stages: the op log innermost (it journals the ops the tool stages run), then the tool
    stages (each Generate's attempts begun on the one inside, so a batching worker still batches them)."""
    stage: Stage = OpLog(pipeline, log) if log is not None else pipeline
    if (tool_validate or tool_repair) and pipeline.engine.tokenizer is None:
        raise ValueError(
            f"{pipeline.engine.path or 'this model'} has no tokenizer.json: the tool stages parse replies"
        )
    if tool_validate:
        stage = ToolValidator(stage, pipeline.engine.tokenizer)
    if tool_repair:
        stage = ToolRepair(stage, pipeline.engine.tokenizer)
    return stage


class Session:
    """One conversation on `engine`: `generate` reuses the cached prefix of each prompt and prefills the rest.
    With `log`, every op and event is appended to that JSONL file (`diffgemma replay` re-executes it)."""

    def __init__(
        self,
        engine: EngineCore,
        log: str | Path | None = None,
        ctx: int | None = None,
        tool_validate: bool = False,
        tool_repair: bool = False,
    ) -> None:
        self.engine = engine
        self.pipeline: Stage = stages(
            Pipeline(engine, ctx, max_conversations=1), log, tool_validate, tool_repair
        )
        self._call(O.Activate(0))

    def _call(
        self, op: O.Op, on_event: Callable[[O.Event], None] | None = None, **kwargs: Any
    ) -> list[O.Event]:
        return call(self.pipeline, op, on_event, **kwargs)

    @property
    def log(self) -> list[int]:
        """The token ids the conversation's cache holds."""
        return list(self.pipeline.active.log)

    def reset(self) -> None:
        self._call(O.AlignTo([]))

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        seed: int = 42,
        on_step: Callable[[StepInfo], None] | None = None,
        on_block: Callable[[list[int]], None] | None = None,
        *,
        cancel: CancelToken | None = None,
        think: bool = False,
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
        logprobs: int | None = None,
        sampler: SamplerConfig | None = None,
        **sampler_overrides: Any,
    ) -> GenerateOutput:
        """A reply to the whole conversation `prompt` (ids, a string or messages, as `Engine.generate` takes), under
        `sampler` (default the engine's) with `sampler_overrides`."""
        check_int("max_new_tokens", max_new_tokens, minimum=1, optional=True)
        check_int("seed", seed)
        check_int("logprobs", logprobs, minimum=0, optional=True)
        if sampler is not None and not isinstance(sampler, SamplerConfig):
            raise TypeError(f"sampler must be a SamplerConfig, got {type(sampler).__name__}")
        ids = self.engine.prompt_ids(prompt, think=think, tools=tools, raw=raw)
        ctx = self.pipeline.registry.ctx
        if len(ids) + 1 > ctx:
            raise ContextOverflow(f"prompt of {len(ids)} tokens does not fit the context of {ctx}")
        cfg = sampler or self.engine.sampler
        if sampler_overrides:
            cfg = cfg.replace(**sampler_overrides)
        fields = None if cfg == self.engine.sampler else sampler_fields(cfg)
        (aligned,) = self._call(O.AlignTo(ids))
        reused = aligned.reused

        def on_event(event: O.Event) -> None:
            if isinstance(event, O.Committed) and on_block is not None:
                on_block(event.ids)

        op = O.Generate(ids[reused:], seed, max_new_tokens, fields, logprobs)
        self._call(op, on_event, on_step=on_step, cancel=cancel)
        out = self.pipeline.last_output
        assert out is not None
        out.reused_tokens = reused
        return self.engine.parse(out)

    def score(self, schema: dict[str, Any], state: Any, seed: int = 42) -> dict[str, Any]:
        """Answer a question schema (`chat.questions`: the JSON object of a schema request's system message) about
        `state` by scored reads; returns the reply object. The schema's prefix stays cached for the next state."""
        if not isinstance(schema, dict):  # a JSON string given as is would fail deep inside, on schema.get
            hint = ": parse it first (json.loads)" if isinstance(schema, (str, bytes)) else ""
            raise TypeError(f"schema must be a dict (a question schema), got {type(schema).__name__}{hint}")
        check_int("seed", seed)
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"state must be JSON-serializable (it is sent as JSON): {e}") from None
        tok = self.engine.need_tokenizer()
        prepared = scoring.prepare(tok, self.engine.config.canvas_length, schema, state, seed)
        pad = tok.pad_id if tok.pad_id is not None else 0
        ops = scoring.score(*prepared, self.engine.config.vocab_size, pad)
        events = None
        while True:
            try:
                op = ops.send(events)
            except StopIteration as done:
                return done.value
            events = self._call(op)


class Engine(EngineCore):
    """What `diffgemma.load` returns: an `EngineCore` (model, runner, sampler, tokenizer, `warm_up`) whose one-shot
    `generate` and `score` are clients of the token pipeline, as `ask`, `chat` and `serve` are. Each keeps one
    `Session` of its own (the runner's captured denoise graphs are tied to a cache, so a fresh one per call would
    capture them again each time): one call at a time per engine."""

    def __init__(
        self,
        runner: ModelRunner | DiffusionGemma,
        sampler: SamplerConfig,
        path: Path | None = None,
        max_tokens: int = LOAD_CONTEXT,
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        super().__init__(runner, sampler, path, max_tokens, tokenizer)
        self._oneshot: Session | None = None  # `generate`'s conversation, emptied each call
        self._scorer: Session | None = None  # `score`'s, kept: a schema's prefix is reused by the next state

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        seed: int = 42,
        on_step: Callable[[StepInfo], None] | None = None,
        on_block: Callable[[list[int]], None] | None = None,
        *,
        cancel: CancelToken | None = None,
        sampler: SamplerConfig | None = None,
        think: bool = False,
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
        logprobs: int | None = None,
        **sampler_overrides: Any,
    ) -> GenerateOutput:
        """A reply to `prompt` (token ids, a string as one user turn, or an OpenAI-style message list) on an empty
        conversation: `Session.generate` on the engine's own session, emptied first. With a tokenizer, out.text /
        out.reasoning / out.tool_calls are set. A conversation that reuses its cache turn after turn is a `Session`."""
        if self._oneshot is None:
            self._oneshot = Session(self)
        self._oneshot.reset()
        return self._oneshot.generate(
            prompt, max_new_tokens, seed, on_step, on_block, cancel=cancel, think=think, tools=tools, raw=raw,
            logprobs=logprobs, sampler=sampler, **sampler_overrides,
        )  # fmt: skip

    def score(self, schema: dict[str, Any], state: Any, seed: int = 42) -> dict[str, Any]:
        """Answer a question schema about `state` by scored reads (`Session.score`, on a session the engine keeps, so
        that the schema's prefix is reused by the next state)."""
        if self._scorer is None:
            self._scorer = Session(self)
        return self._scorer.score(schema, state, seed)


load = Engine.load  # `diffgemma.load`: `EngineCore.load`, building an `Engine`
