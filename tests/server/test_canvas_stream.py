"""The streamed canvas (`stream_options.canvas`, diffgemma's extension): named `canvas` events with each denoise
step's rows, before the block's content; standard clients that do not ask see standard chunks only."""

from __future__ import annotations

import json

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx

from tests.server.conftest import MODEL

USER = [{"role": "user", "content": "Count from 1 to 20."}]


def _events(server, **body) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event of a streamed chat."""
    out, name = [], None
    req = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 40, "seed": 3, **body}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=req, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((name, line[len("data: ") :]))
                name = None
    return out


def test_canvas_events_come_per_step_before_the_content(server, engine) -> None:
    events = _events(server, stream_options={"canvas": True, "canvas_interval_ms": 0})
    frames = [json.loads(d) for name, d in events if name == "canvas"]
    assert len(frames) >= 2
    c = engine.config.canvas_length
    first = frames[0]
    assert first["object"] == "diffgemma.canvas" and (first["block"], first["step"]) == (0, 1)
    assert len(first["tokens"]) == len(first["accepted"]) == len(first["entropy"]) == c
    assert all(isinstance(t, str) for t in first["tokens"]) and all(h >= 0 for h in first["entropy"])
    steps = [(f["block"], f["step"]) for f in frames]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # every step once, in order
    # a block's frames come before its content: the first content chunk follows block 0's frames
    names = [name for name, _ in events]
    chunks = [json.loads(d) for name, d in events if name is None and d != "[DONE]"]
    first_content = next(
        i for i, (name, d) in enumerate(events)
        if name is None and d != "[DONE]" and json.loads(d)["choices"] and json.loads(d)["choices"][0]["delta"].get("content")
    )  # fmt: skip
    assert names[:first_content].count("canvas") >= 1
    assert sum(len(ch["choices"][0]["delta"].get("content") or "") for ch in chunks if ch["choices"]) > 0


def test_without_the_option_the_stream_is_standard(server) -> None:
    events = _events(server)
    assert events and all(name is None for name, _ in events)


def test_the_interval_bounds_the_frames(server) -> None:
    every = _events(server, stream_options={"canvas": True, "canvas_interval_ms": 0})
    sparse = _events(server, stream_options={"canvas": True, "canvas_interval_ms": 60_000})
    count = lambda ev: sum(name == "canvas" for name, _ in ev)  # noqa: E731
    assert count(sparse) == 1 and count(every) > 1  # the first step always, then none within a minute


def test_canvas_option_errors(server) -> None:
    def post(**body):
        req = {"model": MODEL, "messages": USER, "max_tokens": 8, **body}
        return httpx.post(server.base + "/v1/chat/completions", json=req, timeout=30)

    r = post(stream_options={"canvas": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.canvas"
    r = post(stream=True, stream_options={"canvas_interval_ms": 10})
    assert r.status_code == 400 and "canvas" in r.json()["error"]["message"]
    r = post(stream=True, stream_options={"canvas": True, "canvas_interval_ms": -1})
    assert r.status_code == 400
    r = httpx.post(
        server.base + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"canvas": True}},
        timeout=30,
    )
    assert r.status_code == 400 and "chat" in r.json()["error"]["message"]
