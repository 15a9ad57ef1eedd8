"""Many clients' conversations against one server with fewer cached conversations than clients (issue 57 item 10):
each conversation gets the replies of its solo run, and a failure of the server's own making is a 500, never a 4xx."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from diffgemma.engine.engine import ContextOverflow
from diffgemma.server import create_app
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Pipeline, call
from tests.live_server import free_port, stop, wait_up
from tests.server.conftest import CTX, MODEL, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

CLIENTS = 32
# Arithmetic on the client's own number (what the demo model was trained on): replies that differ between clients.
TURNS = ["What is {k} + 7?", "What is {k} + 15?", "Count from 1 to 5."]
# Every client sends this first (more than MIN_FORK_TOKENS, below SALVAGE_MIN_PREFIX): a new client's first turn is a
# fork of whichever cached conversation it finds, the route the failure took.
SYSTEM = (
    "You are the assistant of the harbour office. Answer in one short line, and show the sum you worked out."
)
# Small and fixed so that 32 x 3 turns twice (solo, then concurrent) stay within a minute on 2 idle cores.
BODY = {"max_tokens": 8, "max_denoising_steps": 2}


def _conversation(client: httpx.Client, model: str, k: int) -> list[tuple[int, Any]]:
    """Client k's three turns, each sending the previous replies: (status, reply text or error body) per turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    got: list[tuple[int, Any]] = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn.format(k=k)})
        r = client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "seed": 100 + k, **BODY},
            timeout=300,
        )
        if r.status_code != 200:
            got.append((r.status_code, r.text))
            return got
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        reply = choice["message"]["content"]
        got.append((200, (reply, choice["finish_reason"], usage["completion_tokens"])))
        messages.append({"role": "assistant", "content": reply})
    return got


def test_32_concurrent_three_turn_conversations_each_equal_their_solo_run(tmp_path) -> None:
    """`diffgemma serve` on the bundled demo model (CPU, fp32, 4 cached conversations): each of 32 conversations run
    alone, one after another, then all 32 at once. Every turn is a 200 and every conversation's replies (text,
    finish reason, token count) are those of its solo run."""
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "diffgemma.cli",
        "serve",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--ctx",
        "1024",
    ]
    with log.open(
        "w"
    ) as err:  # a file, not a pipe: the route log of 200 requests would fill a pipe and block
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base, log=log)
        with httpx.Client(base_url=base) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            started = time.perf_counter()
            solo = [_conversation(c, model, k) for k in range(CLIENTS)]
            solo_s = time.perf_counter() - started
        assert all(status == 200 for conv in solo for status, _ in conv), solo
        assert len({conv[0][1][0] for conv in solo}) >= CLIENTS // 2  # the replies tell the clients apart

        def client(k: int) -> list[tuple[int, Any]]:
            with httpx.Client(base_url=base) as own:  # a connection of its own, as separate clients have
                return _conversation(own, model, k)

        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            together = list(pool.map(client, range(CLIENTS)))
        concurrent_s = time.perf_counter() - started
    finally:
        stop(proc)
    text = log.read_text()
    routes = {r: text.count(f"route: {r} (") for r in ("fork", "salvage", "re-prefill")}
    print(f"solo {solo_s:.1f} s, concurrent {concurrent_s:.1f} s; routes {routes}, of them a fork of the only idle "
          f"conversation cut in place: {text.count('the only idle conversation')}")  # fmt: skip
    failed = [(k, conv[-1]) for k, conv in enumerate(together) if conv[-1][0] != 200]
    assert not failed, failed
    assert "engine job failed" not in text
    differ = [k for k in range(CLIENTS) if together[k] != solo[k]]
    assert not differ, [(k, solo[k], together[k]) for k in differ]
    assert (
        "route: fork" in text or "route: salvage" in text
    )  # the forking routes ran, not only new and continue


@pytest.fixture
def tiny_server(engine):
    """A server over the tiny model, its registry reachable for the fault injected below."""
    with ServerThread(create_app(engine, ctx=CTX)) as srv:
        yield srv


def test_a_routing_fault_is_a_logged_500_and_a_context_refusal_stays_a_400(
    tiny_server, monkeypatch, caplog
) -> None:
    """The issue's 'cannot truncate' was the server's own fault, answered 400: a failed op other than a context
    refusal is now a 500 with the OpenAI error body (and logged); the engine's context refusal is still the
    client's 400 context_length_exceeded."""
    registry = tiny_server.app.state.registry
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def broken(ids: list[int]) -> Any:
        raise ValueError("cannot truncate to 17: cache holds 0 positions")

    monkeypatch.setattr(registry, "route", broken)
    with caplog.at_level(logging.ERROR, logger="diffgemma.server"):
        r = httpx.post(tiny_server.base + "/v1/chat/completions", json=body, timeout=30)
        stream = httpx.post(
            tiny_server.base + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
        )
    error = r.json()["error"]
    assert (
        r.status_code == 500
        and error["type"] == "server_error"
        and "cannot truncate to 17" in error["message"]
    )
    assert set(error) == {"message", "type", "param", "code"}
    assert '"type": "server_error"' in stream.text and "cannot truncate to 17" in stream.text
    assert "engine job failed" in caplog.text and "cannot truncate to 17" in caplog.text

    def full(ids: list[int]) -> Any:
        raise ContextOverflow("prompt of 2000 tokens does not fit the context (0/1024 used)")

    monkeypatch.setattr(registry, "route", full)
    r = httpx.post(tiny_server.base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    monkeypatch.undo()
    ok = httpx.post(tiny_server.base + "/v1/chat/completions", json=body, timeout=30)
    assert ok.status_code == 200  # the worker outlived both


def test_op_failures_say_whether_the_request_size_caused_them(engine) -> None:
    """Through the pipeline's events: a prompt past the context comes back as ContextOverflow, a stale rewind (the
    caller's use of the ops) as a plain ValueError."""
    p = Pipeline(engine, CTX, max_conversations=1)
    call(p, O.Activate(0))
    with pytest.raises(ContextOverflow, match="does not fit"):
        call(p, O.Generate([5] * (CTX + 10), 1, 4))
    call(p, O.Extend([5, 6, 7, 8]))
    late = call(p, O.Mark())[0].kv
    call(p, O.Rewind((late[0], 2)))
    with pytest.raises(ValueError, match="stale KV position") as refused:
        call(p, O.Rewind(late))
    assert not isinstance(refused.value, ContextOverflow)
