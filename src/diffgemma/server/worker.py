"""The engine worker: one thread owns the model and every KV cache (the token pipeline); jobs reach it through a
bounded queue and run there, speaking the pipeline's ops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from diffgemma.engine.generate import CancelToken
from diffgemma.server.errors import APIError
from diffgemma.session.pipeline import Pipeline

log = logging.getLogger("diffgemma.server")


class Job(Protocol):
    cancel: CancelToken
    enqueued_at: float

    def run(self, pipeline: Pipeline) -> None: ...

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


class Worker:
    def __init__(
        self, pipeline: Pipeline, max_queue: int, on_error: Callable[[BaseException], None] | None = None
    ):
        self.pipeline = pipeline
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="diffgemma-engine", daemon=True)
        self._busy = False
        self._on_error = on_error

    @property
    def depth(self) -> int:
        """Jobs waiting plus the one running."""
        return self._queue.qsize() + int(self._busy)

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
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._busy = True
            try:
                if job.cancel.cancelled:
                    job.fail(APIError(499, "the client went away before its turn", code="cancelled"))
                else:
                    job.run(self.pipeline)
            except APIError as exc:
                job.fail(exc)
            except BaseException as exc:  # the worker must outlive any one request
                log.exception("engine job failed")
                if self._on_error is not None:
                    self._on_error(exc)
                job.fail(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
            finally:
                self._busy = False
