"""`Session`: a conversation driven through the token pipeline, the way `ask`, `chat` and Python code reach the
model: each call is ops (AlignTo, Generate) on one pipeline, journaled when a log path is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffgemma.config import SamplerConfig
from diffgemma.engine.engine import Engine, Prompt
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session import ops as O
from diffgemma.session import scoring
from diffgemma.session.oplog import OpLog
from diffgemma.session.pipeline import Pipeline, call, sampler_fields
from diffgemma.session.stage import Stage
from diffgemma.session.tools import ToolRepair, ToolValidator


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
        engine: Engine,
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
        ids = self.engine.prompt_ids(prompt, think=think, tools=tools, raw=raw)
        ctx = self.pipeline.registry.ctx
        if len(ids) + 1 > ctx:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {ctx}")
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
        tok = self.engine._need_tokenizer()
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
