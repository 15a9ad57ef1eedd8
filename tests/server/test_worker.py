"""The batching worker's failure paths: a forward that fails fails the requests whose turns were in it (500) and no
other, and frees their conversations; the worker stops with turns still running."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from diffgemma.server import create_app
from tests.server.conftest import CTX, MODEL, ServerThread


def _ask(client, i: int, max_tokens: int = 40):
    messages = [{"role": "user", "content": f"Question {i}?"}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, seed=i)


def test_a_failed_forward_fails_its_requests_and_frees_their_conversations(engine, monkeypatch):
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(plan)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    with ServerThread(create_app(engine, ctx=CTX, max_conversations=3)) as server:
        client = server.client()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: _try(client, i), range(3)))
        failed = [r for r in results if isinstance(r, openai.InternalServerError)]
        assert failed and all("injected forward failure" in str(r) for r in failed)
        server.check_registry()
        assert not server.app.state.registry.busy  # every conversation free again
        monkeypatch.setattr(engine.runner, "execute", real)
        assert _ask(client, 7).choices[0].finish_reason in ("stop", "length")  # the worker lives on


def _try(client, i):
    try:
        return _ask(client, i)
    except openai.APIError as e:
        return e


def test_the_worker_stops_with_turns_running(engine):
    server = ServerThread(create_app(engine, ctx=CTX, max_conversations=2))
    server.__enter__()
    client = server.client()
    started = threading.Event()

    def long_stream():
        try:
            for _chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "A long story."}],
                max_tokens=900,
                stream=True,
            ):
                started.set()
        except (openai.APIError, Exception):  # noqa: BLE001 - the server goes away under it
            pass

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(20)
    t0 = time.monotonic()
    server.__exit__(None, None, None)
    worker = server.app.state.worker
    assert not worker._thread.is_alive() and time.monotonic() - t0 < 10
