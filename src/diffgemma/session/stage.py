"""`Stage`: the token pipeline's interface, which the terminal (`pipeline.Pipeline`) and every stage around it
(`oplog.OpLog`, `tools.ToolValidator`, `tools.ToolRepair`) implement, and `Around`, the base of a stage over an
inner one: each member forwards to the inner stage unless the stage overrides it.

A Generate runs either at once (`run`) or begun beside others (`begin_generate`, a scheduler `Request`; the
batching worker steps it with the rest and calls `end_generate` when its turn is done). `end_generate` may answer
with a new `Request` that runs in the first one's place (a tool stage's next attempt); `run` drives the same
requests one after the other, so both ways give the same events and tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from diffgemma.config import SamplerConfig
from diffgemma.engine.batch import Request
from diffgemma.engine.engine import EngineCore
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session import ops as O
from diffgemma.session.conversation import Conversation
from diffgemma.session.registry import Registry

Emit = Callable[[O.Event], None]
OnStep = Callable[[StepInfo], None]
# What `end_generate` answers: the Generate's output (its `Replied` emitted), the Request to run in its place (its
# next attempt: submit it and end it in turn), or None (it failed: its `Failed` emitted).
Ended = GenerateOutput | Request | None


class Stage(ABC):
    """The pipeline's interface: ops run (`run`), Generates begun and ended beside others, and the state that
    callers read (the engine, the conversations, the active one, the last Generate's output)."""

    @property
    @abstractmethod
    def engine(self) -> EngineCore:
        """The engine every op runs on."""

    @property
    @abstractmethod
    def registry(self) -> Registry:
        """The conversations (routing, forks, eviction, the busy ones)."""

    @property
    @abstractmethod
    def active(self) -> Conversation | None:
        """The conversation the next op acts on."""

    @property
    @abstractmethod
    def last_output(self) -> GenerateOutput | None:
        """The last ended Generate's output with its timings (the events leave them out)."""

    @abstractmethod
    def conv_id(self, conv: Conversation) -> int:
        """The id `Activate` takes for conv."""

    @abstractmethod
    def sampler(self, fields: dict | None) -> SamplerConfig:
        """The engine's sampler config, or the one these fields (`sampler_fields`) describe."""

    @abstractmethod
    def run(
        self, op: O.Op, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> None:
        """Execute op, emitting its events in order; a refused op emits `Failed`."""

    @abstractmethod
    def begin_generate(
        self, op: O.Generate, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> Request | None:
        """Open op's turn as a scheduler Request (its conversation busy until it ends); None, with `Failed`
        emitted, when it is refused."""

    @abstractmethod
    def end_generate(self, request: Request) -> Ended:
        """Close a begun Generate whose turn is done (`Ended` says what came of it)."""

    @abstractmethod
    def abort_generate(self, request: Request) -> None:
        """Drop a begun Generate that cannot end (a forward beside it failed): its conversation emptied and freed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the running op between denoise steps (any thread)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the stage holds open (a journal)."""


class Around(Stage):
    """A stage over `inner`: every member forwards to it; a subclass overrides the ones it changes."""

    def __init__(self, inner: Stage) -> None:
        self.inner = inner

    @property
    def engine(self) -> EngineCore:
        return self.inner.engine

    @property
    def registry(self) -> Registry:
        return self.inner.registry

    @property
    def active(self) -> Conversation | None:
        return self.inner.active

    @property
    def last_output(self) -> GenerateOutput | None:
        return self.inner.last_output

    def conv_id(self, conv: Conversation) -> int:
        return self.inner.conv_id(conv)

    def sampler(self, fields: dict | None) -> SamplerConfig:
        return self.inner.sampler(fields)

    def run(
        self, op: O.Op, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> None:
        self.inner.run(op, emit, on_step=on_step, cancel=cancel)

    def begin_generate(
        self, op: O.Generate, emit: Emit, on_step: OnStep | None = None, cancel: CancelToken | None = None
    ) -> Request | None:
        return self.inner.begin_generate(op, emit, on_step=on_step, cancel=cancel)

    def end_generate(self, request: Request) -> Ended:
        return self.inner.end_generate(request)

    def abort_generate(self, request: Request) -> None:
        self.inner.abort_generate(request)

    def cancel(self) -> None:
        self.inner.cancel()

    def close(self) -> None:
        self.inner.close()
