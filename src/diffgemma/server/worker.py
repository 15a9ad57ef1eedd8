"""The engine worker: one thread owns the model and every KV cache (the token pipeline). Jobs reach it through a
bounded queue and run there as generators of ops (`Run`): the worker runs each op for its job and sends back the
events. A job's `Generate` is begun on the pipeline (its stages included) and joins the `Scheduler`, so the turns of
up to one job a conversation advance together, one forward a step for all their canvases; the job resumes when its
Generate ends, which a tool stage may answer with its next attempt's request, stepped in the same way. A job's other
ops (and a stage's ops between attempts) run between forwards, each job's run of them at once (no other job's op
comes between them), so a conversation is only ever touched by the job that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from diffgemma.engine.batch import Request, Scheduler
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.server.errors import APIError
from diffgemma.session import ops as O
from diffgemma.session.conversation import Conversation
from diffgemma.session.pipeline import call, collector, failure
from diffgemma.session.stage import Stage

log = logging.getLogger("diffgemma.server")


@dataclass
class Run:
    """What a job's `steps` yield: an op to run on its behalf. Its events come back; a `Failed` one is thrown into the
    job as ValueError. `on_event` sees each event as it comes (a Generate's commits, for streaming)."""

    op: O.Op
    on_event: Callable[[O.Event], None] | None = None
    cancel: CancelToken | None = None
    output: GenerateOutput | None = None  # a Generate's, with its timings (the events leave them out)
    on_step: Callable[[StepInfo], None] | None = None  # a Generate's denoise steps (the streamed canvas)


Steps = Generator[Run, list[O.Event], None]


class Job(Protocol):
    cancel: CancelToken
    enqueued_at: float

    def steps(self) -> Steps: ...

    def fail(self, error: APIError) -> None: ...


class QueueFull(Exception):
    pass


class Channel:
    """Events from the worker thread to one request's asyncio task."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, event: Any) -> None:
        # RuntimeError: the loop is gone (server shutting down) and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(self._queue.get(), timeout)


@dataclass
class _Active:
    job: Job
    steps: Steps
    conv: Conversation | None = None  # the conversation its Route chose
    request: Request | None = None  # its Generate in the scheduler
    run: Run | None = None  # the Run of that Generate
    events: list[O.Event] = field(default_factory=list)
    done: bool = False


class Worker:
    def __init__(
        self,
        pipeline: Stage,
        max_queue: int,
        on_error: Callable[[BaseException], None] | None = None,
        max_batch: int = 16,
        on_forward: Callable[[int], None] | None = None,
    ):
        self.pipeline = pipeline
        self.scheduler = Scheduler(pipeline.engine.runner, max_batch)
        self.capacity = pipeline.registry.max_conversations  # a running job holds one conversation
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="diffgemma-engine", daemon=True)
        self._active: list[_Active] = []
        self._on_error = on_error
        self._on_forward = on_forward

    @property
    def depth(self) -> int:
        """Jobs waiting plus those running."""
        return self._queue.qsize() + len(self._active)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        while True:  # the sentinel must get in even when the queue is full
            try:
                self._queue.put(None, timeout=0.1)
                break
            except queue.Full:
                pass
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        job.enqueued_at = time.perf_counter()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _loop(self) -> None:
        stopping = False
        while True:
            while not stopping and len(self._active) < self.capacity:
                try:
                    job = self._queue.get(block=not self._active)  # wait only when nothing runs
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    for a in self._active:  # finish what runs quickly: each turn ends at its next step
                        a.job.cancel.cancel()
                    break
                if job.cancel.cancelled:
                    job.fail(APIError(499, "the client went away before its turn", code="cancelled"))
                    continue
                a = _Active(job, job.steps())
                self._active.append(a)
                self._advance(a, None, None)
            if self.scheduler.active:
                self._step()
            for a in self._active:
                if a.request is not None and a.request.done:
                    self._end(a)
            self._active = [a for a in self._active if not a.done]
            if stopping and not self._active:
                return

    def _end(self, a: _Active) -> None:
        """End a's Generate, whose turn is done: its next attempt submitted in its place (a tool stage's), or the job
        run on with its events (a `Failed` thrown into it)."""
        request, a.request = a.request, None
        assert request is not None and a.run is not None
        try:
            ended = self.pipeline.end_generate(request)
        except BaseException as exc:  # noqa: BLE001 - reported to its job
            self._crash(a, exc)
            return
        if isinstance(ended, Request):
            a.request = self.scheduler.submit(ended)
        elif ended is None:
            self._advance(a, None, failure(a.events[-1]))
        else:
            a.run.output = ended
            self._advance(a, a.events, None)

    def _step(self) -> None:
        """One scheduler step; a failure fails every job whose turn was in it, never the worker."""
        try:
            n = len(self.scheduler.forwards)
            self.scheduler.step()
            if self._on_forward is not None:
                for size in self.scheduler.forwards[n:]:
                    self._on_forward(size)
            del self.scheduler.forwards[:-64]
        except BaseException as exc:  # noqa: BLE001
            for a in self._active:
                if a.request is not None:
                    self.pipeline.abort_generate(a.request)
                    a.request = None
                    self._crash(a, exc)
            self.scheduler.requests = []

    def _advance(self, a: _Active, value: list[O.Event] | None, exc: BaseException | None) -> None:
        """Run a's ops until it parks on a Generate or ends."""
        while True:
            try:
                item = a.steps.throw(exc) if exc is not None else a.steps.send(value)
            except StopIteration:
                a.done = True
                return
            except APIError as e:
                a.job.fail(e)
                a.done = True
                return
            except BaseException as e:  # noqa: BLE001 - the worker must outlive any one request
                self._crash(a, e)
                return
            value, exc = None, None
            try:
                if a.conv is not None and self.pipeline.active is not a.conv:
                    call(self.pipeline, O.Activate(self.pipeline.conv_id(a.conv)))
                if isinstance(item.op, O.Generate):
                    a.events = []
                    request = self.pipeline.begin_generate(
                        item.op, collector(a.events, item.on_event), on_step=item.on_step, cancel=item.cancel
                    )
                    if request is None:
                        exc = failure(a.events[-1])  # a context refusal stays one (the job's 400)
                        continue
                    a.request, a.run = request, item
                    self.scheduler.submit(request)
                    return
                value = call(self.pipeline, item.op, item.on_event, cancel=item.cancel, on_step=item.on_step)
                if isinstance(item.op, O.Route):
                    a.conv = self.pipeline.active
            except ValueError as e:
                exc = e
            except BaseException as e:  # noqa: BLE001
                exc = e

    def _crash(self, a: _Active, exc: BaseException) -> None:
        log.error("engine job failed", exc_info=exc)
        if self._on_error is not None:
            self._on_error(exc)
        a.job.fail(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
        a.done = True
        with contextlib.suppress(BaseException):
            a.steps.close()
