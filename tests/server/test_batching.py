"""The server batches concurrent requests: their turns share denoise forwards (one canvas a conversation), each
request gets the tokens of its solo run, and the op log of the interleaved session replays identically."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from diffgemma.chat.parser import BadCall
from diffgemma.cli import app
from diffgemma.server import create_app
from diffgemma.session import tools
from tests.server.conftest import CTX, MODEL, ServerThread
from tests.server.test_chat import metric


def _ask(client, i: int, stream: bool = False, max_tokens: int | None = None) -> str:
    messages = [{"role": "user", "content": f"Tell me about number {i}." + " More." * i}]
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens or 40 + 8 * i, seed=i)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )


def test_concurrent_requests_share_forwards_and_get_their_solo_tokens(engine, model_dir, tmp_path):
    with ServerThread(create_app(engine, ctx=CTX, max_conversations=1)) as solo_server:
        solo = [_ask(solo_server.client(), i) for i in range(6)]
    log_dir = tmp_path / "logs"
    with ServerThread(create_app(engine, ctx=CTX, max_conversations=6, log_dir=log_dir)) as server:
        client = server.client()
        before = metric(server, "diffgemma_canvases_per_forward_count")
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: _ask(client, i, stream=i % 2 == 1), range(6)))
        server.check_registry()
        forwards = metric(server, "diffgemma_canvases_per_forward_count") - before
        canvases = metric(server, "diffgemma_canvases_per_forward_sum")
        batched = forwards - metric(server, "diffgemma_canvases_per_forward_bucket", le="1.0")
    assert got == solo
    assert batched > 0 and canvases > forwards  # some forwards held several canvases
    res = CliRunner().invoke(app, ["replay", str(log_dir / "ops.jsonl"), "-m", str(model_dir)])
    assert res.exit_code == 0 and res.stdout.startswith("identical: 1 session(s)"), res.output


@pytest.mark.parametrize("stage", ["tool_validate", "tool_repair"])
def test_tool_stage_requests_share_forwards(engine, model_dir, tmp_path, monkeypatch, stage):
    """With a tool stage on, every reply judged a bad tool call: each request's attempts (the validator's three, the
    repair's two) are scheduler requests that share forwards with the other requests', each request gets its solo
    tokens, and the interleaved op log (the stage's own ops in it) replays identically."""
    monkeypatch.setattr(
        tools, "bad_calls", lambda tok, ids, finish: [BadCall("<|tool_call>call:f{<tool_call|>")]
    )
    n = 4
    with ServerThread(create_app(engine, ctx=CTX, max_conversations=1, **{stage: True})) as solo_server:
        solo = [_ask(solo_server.client(), i, max_tokens=16 + 4 * i) for i in range(n)]
    log_dir = tmp_path / "logs"
    with ServerThread(
        create_app(engine, ctx=CTX, max_conversations=n, log_dir=log_dir, **{stage: True})
    ) as server:
        client = server.client()
        before = metric(server, "diffgemma_canvases_per_forward_count")
        with ThreadPoolExecutor(n) as pool:
            got = list(
                pool.map(lambda i: _ask(client, i, stream=i % 2 == 1, max_tokens=16 + 4 * i), range(n))
            )
        server.check_registry()
        forwards = metric(server, "diffgemma_canvases_per_forward_count") - before
        canvases = metric(server, "diffgemma_canvases_per_forward_sum")
        batched = forwards - metric(server, "diffgemma_canvases_per_forward_bucket", le="1.0")
    assert got == solo
    assert batched > 0 and canvases > forwards  # some forwards held several canvases
    ops = [
        json.loads(line)["op"]["type"]
        for line in (log_dir / "ops.jsonl").read_text().splitlines()
        if '"op"' in line
    ]
    attempts = 3 if stage == "tool_validate" else 2  # the repair rewinds once, after its regeneration
    assert ops.count("Generate") == attempts * n and ops.count("Rewind") == (attempts - 1) * n
    res = CliRunner().invoke(app, ["replay", str(log_dir / "ops.jsonl"), "-m", str(model_dir)])
    assert res.exit_code == 0 and res.stdout.startswith("identical: 1 session(s)"), res.output
