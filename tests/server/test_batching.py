"""The server batches concurrent requests: their turns share denoise forwards (one canvas a conversation), each
request gets the tokens of its solo run, and the op log of the interleaved session replays identically."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from typer.testing import CliRunner

from diffgemma.cli import app
from diffgemma.server import create_app
from tests.server.conftest import CTX, MODEL, ServerThread
from tests.server.test_chat import metric


def _ask(client, i: int, stream: bool = False) -> str:
    messages = [{"role": "user", "content": f"Tell me about number {i}." + " More." * i}]
    kw = dict(model=MODEL, messages=messages, max_tokens=40 + 8 * i, seed=i)
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
