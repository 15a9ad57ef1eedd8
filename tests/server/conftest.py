"""A real server on an ephemeral loopback port (uvicorn in a thread) over a tiny random model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from openai import OpenAI

import diffgemma
import diffgemma.session.pipeline as pipeline_module
from diffgemma.engine.generate import GenerateOutput
from diffgemma.server import create_app
from diffgemma.session import ops as O
from diffgemma.testing import write_tiny_checkpoint

CTX = 1024
MODEL = "tiny-diffgemma"


class ServerThread:
    def __init__(self, app: Any) -> None:
        self.app = app
        # IPPROTO_TCP, so that asyncio sets TCP_NODELAY on its connections (else each keep-alive request of a
        # test waits ~40 ms for a delayed ACK)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def check_registry(self, timeout: float = 10) -> None:
        """Once the engine worker is idle (a reply's turn is finalized after the reply is sent), check every cached
        conversation's invariant."""
        deadline = time.monotonic() + timeout
        while self.app.state.worker.depth and time.monotonic() < deadline:
            time.sleep(0.01)
        self.app.state.registry.check()

    def client(self, **kwargs: Any) -> OpenAI:
        kwargs.setdefault("api_key", "unused")
        return OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=30, **kwargs)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / MODEL, seed=3)


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> diffgemma.Engine:
    return diffgemma.load(model_dir, "cpu", max_tokens=CTX, max_denoising_steps=4)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory) -> Iterator[ServerThread]:
    app = create_app(engine, ctx=CTX, log_dir=tmp_path_factory.mktemp("log"))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return server.client()


class Script:
    """Stands in for the block loop (`drive`, under the pipeline's Generate): the turn has prefilled the prompt into
    the real KV (so reuse stays real); returns chosen replies, one per generation, committed in blocks of `block`
    tokens."""

    def __init__(self, engine: diffgemma.Engine, replies: list[str | list[int]], block: int = 4) -> None:
        self.engine = engine
        self.replies = list(replies)
        self.block = block
        self.prompts: list[list[int]] = []  # the uncached prompt tokens of each generation

    def __call__(self, turn, on_step=None, cancel=None, on_commit=None) -> GenerateOutput:
        self.prompts.append(list(turn.prompt_ids))
        reply = self.replies.pop(0)
        ids = self.engine.tokenizer.encode(reply) if isinstance(reply, str) else list(reply)
        ids = ids[: turn.max_new]
        out = turn.out
        out.finish_reason, out.stop_token = "stop", 106
        for start in range(0, len(ids), self.block):
            if cancel is not None and cancel.cancelled:
                out.finish_reason, out.stop_token = "cancelled", None
                break
            if out.token_ids:  # the previous block is prefilled before the next one, as the real loop does
                turn.model.prefill(torch.tensor([out.token_ids[-self.block :]], dtype=torch.long), turn.kv)
                out.cached_tokens = len(out.token_ids)
            chunk = ids[start : start + self.block]
            out.token_ids += chunk
            out.steps += 1
            out.blocks += 1
            turn.done = start + self.block >= len(ids)
            if on_commit is not None:
                on_commit(turn, chunk)
        turn.done = True
        return out


_BEGIN = pipeline_module.Pipeline.begin_generate


def drive_at_begin(monkeypatch, loop: Callable[..., GenerateOutput]) -> None:
    """Every Generate's turn run to its end by `loop(turn, on_step, cancel, on_commit)` as soon as it is begun, in
    place of the block loop (the worker's scheduler then finds it done; a lone Generate's `drive` too)."""

    def begin(self, op, emit, on_step=None, cancel=None):
        request = _BEGIN(
            self, op, emit, on_step, cancel
        )  # the real one, however often a test scripts replies
        if request is not None:
            loop(request.turn, request.on_step, request.cancel, request.on_commit)
        return request

    monkeypatch.setattr(pipeline_module.Pipeline, "begin_generate", begin)


@pytest.fixture
def script(engine, monkeypatch) -> Callable[..., Script]:
    def make(*replies: str | list[int], block: int = 4) -> Script:
        s = Script(engine, list(replies), block)
        drive_at_begin(monkeypatch, s)
        return s

    return make


@pytest.fixture
def renders(engine, monkeypatch) -> list[dict[str, Any]]:
    """Every prompt the server encodes: {'text', 'messages', 'tools', 'enable_thinking', 'add_generation_prompt'}."""
    seen: list[dict[str, Any]] = []
    tok = engine.tokenizer
    real = tok.encode_chat

    def spy(messages, tools=None, add_generation_prompt=True, enable_thinking=False):
        options = dict(
            tools=tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )
        seen.append(dict(text=tok.render(messages, **options), messages=messages, **options))
        return real(messages, **options)

    monkeypatch.setattr(tok, "encode_chat", spy)
    return seen


def routed_generate(p: pipeline_module.Pipeline, ids: list[int], seed: int, max_new_tokens: int = 8):
    """One request through the pipeline's ops as the server opens it (Route, AlignTo, Generate; no Finalize): its
    output, `reused_tokens` set, and the conversation it ran on."""
    pipeline_module.call(p, O.Route(ids))
    (aligned,) = pipeline_module.call(p, O.AlignTo(ids))
    pipeline_module.call(p, O.Generate(ids[aligned.reused :], seed, max_new_tokens))
    out = p.last_output
    out.reused_tokens = aligned.reused
    return out, p.active
