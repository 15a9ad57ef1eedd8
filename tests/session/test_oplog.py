"""The op log and replay: ask/chat --log through the pipeline, replay identical (exit 0) or naming the first
differing event (exit 1), another model's log refused in one line."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import diffgemma
from diffgemma.cli import app
from diffgemma.session import ops as O
from diffgemma.session.client import Session
from diffgemma.session.oplog import OpLog, read_log, replay
from diffgemma.session.pipeline import Pipeline


@pytest.fixture(scope="module")
def eng(tiny_a):
    return diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=4, max_tokens=512)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_session_logs_every_op_and_event_and_replays_identically(eng, tmp_path):
    log = tmp_path / "s.jsonl"
    s = Session(eng, log=log)
    first = s.generate("What is 2 + 2?", seed=3, max_new_tokens=40)
    second = s.generate(
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": first.text},
         {"role": "user", "content": "And 3 + 3?"}],
        seed=4, max_new_tokens=40,
    )  # fmt: skip
    assert second.reused_tokens > 0
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600  # token ids of prompts: owner only
    recs = records(log)
    assert list(recs[0]) == ["header"] and recs[0]["header"]["model_id"] != "unknown"
    ops = [r["op"]["type"] for r in recs if "op" in r]
    assert ops == ["Activate", "AlignTo", "Generate", "AlignTo", "Generate"]
    replied = [r["event"] for r in recs if "event" in r and r["event"]["type"] == "Replied"]
    assert replied[0]["token_ids"] == first.token_ids and replied[1]["token_ids"] == second.token_ids
    events = sum(1 for r in recs if "event" in r)
    assert replay(log, eng) == (True, f"identical: 1 session(s), 5 ops, {events} events")


def test_a_changed_token_is_named_and_exits_1(eng, tiny_a, tmp_path):
    log = tmp_path / "s.jsonl"
    Session(eng, log=log).generate("Count to five.", seed=1, max_new_tokens=30)
    runner = CliRunner()
    ok = runner.invoke(app, ["replay", str(log), "-m", str(tiny_a)])
    assert ok.exit_code == 0 and ok.stdout.startswith("identical:"), ok.output
    lines = log.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"Replied"' in line)
    rec = json.loads(lines[i])
    rec["event"]["token_ids"][0] = (rec["event"]["token_ids"][0] + 1) % 1000
    lines[i] = json.dumps(rec)
    log.write_text("\n".join(lines) + "\n")
    bad = runner.invoke(app, ["replay", str(log), "-m", str(tiny_a)])
    assert bad.exit_code == 1
    assert (
        f"line {i + 1}: event" in bad.stdout
        and "of op Generate differs: token_ids first differs at [0]" in bad.stdout
    )


def test_another_models_log_is_refused_in_one_line(eng, tiny_b, tmp_path):
    log = tmp_path / "s.jsonl"
    Session(eng, log=log).generate("hi", seed=1, max_new_tokens=8)
    res = CliRunner().invoke(app, ["replay", str(log), "-m", str(tiny_b)])
    assert res.exit_code == 1
    (line,) = res.stderr.strip().splitlines()
    assert "was recorded on model" in line and "replay it with -m pointing at that model" in line


def test_per_block_ops_and_a_cancel_replay_where_they_struck(eng, tmp_path):
    from diffgemma.engine.generate import CancelToken

    log = tmp_path / "p.jsonl"
    p = OpLog(Pipeline(eng), log)
    sink: list[O.Event] = []
    ids = eng.prompt_ids("Tell me a long story about a fox.")
    for op in (O.Activate(0), O.Extend(ids), O.BeginTurn(seed=9, max_new_tokens=64), O.ProposeBlock()):
        p.run(op, sink.append)
    p.run(O.CommitBlock(5), sink.append)
    p.run(O.EndTurn(), sink.append)
    token, seen = CancelToken(), []

    def on_step(info):
        seen.append(1)
        if len(seen) == 2:
            token.cancel()

    p.run(O.Generate([], seed=2, max_new_tokens=64), sink.append, on_step=on_step, cancel=token)
    p.run(O.KvFingerprint(), sink.append)
    p.close()
    assert sink[-2].finish_reason == "cancelled" and sink[-2].cancel_after == 2
    same, line = replay(log, eng)
    assert same, line


def test_bad_logs_are_refused_naming_the_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"op": {"type": "Ping"}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: op before any header"):
        read_log(log)
    log.write_text('{"header": {}}\n{"op": {"type": "Explode"}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: unknown message type 'Explode'"):
        read_log(log)
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "no such log" in res.stderr


# -- a crash: a journal cut mid-op, then the session the restarted process logged -------------------------------


def _cuts(text: str) -> dict[str, int]:
    """Byte offsets in the middle of the Generate op of a one-reply session: in and after each of its lines."""
    lines = text.encode().splitlines(keepends=True)
    ends = [sum(len(x) for x in lines[: i + 1]) for i in range(len(lines))]
    kinds = [
        next(iter(json.loads(x))) + ":" + str(next(iter(json.loads(x).values())).get("type")) for x in lines
    ]
    g = kinds.index("op:Generate")
    c = kinds.index("event:Committed")
    r = kinds.index("event:Replied")
    assert g < c < r and c + 1 < r, kinds  # the reply took two blocks: a commit stands between op and reply
    mid = lambda i: ends[i] - len(lines[i]) // 2  # noqa: E731
    return {
        "in the op line": mid(g),
        "after the op line": ends[g],
        "in a Committed line": mid(c),
        "after a Committed line": ends[c],
        "in the Replied line": mid(r),
    }


def _replay_cli(log, model) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(diffgemma.__file__).parents[1])}
    cmd = [sys.executable, "-m", "diffgemma.cli", "replay", str(log), "-m", str(model)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _whole(log) -> list[dict]:
    """The records of a journal, its partial line left out."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def test_a_journal_cut_mid_op_replays_its_later_session(eng, tiny_a, tmp_path):
    full = tmp_path / "full.jsonl"
    Session(eng, log=full).generate("Count to five.", seed=1, max_new_tokens=30)
    text = full.read_text()
    for name, cut in _cuts(text).items():
        log = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        log.write_bytes(text.encode()[:cut])  # what kill -9 left
        os.chmod(log, 0o600)
        Session(eng, log=log).generate("And to six?", seed=2, max_new_tokens=30)  # the restarted process
        second = next(
            i for i, line in enumerate(log.read_text().splitlines(), 1) if i > 1 and '"header"' in line
        )
        assert log.read_text().splitlines()[second - 1].startswith('{"header":'), name  # a line of its own
        recs = _whole(log)
        ops, events = sum("op" in r for r in recs), sum("event" in r for r in recs)
        res = _replay_cli(log, tiny_a)
        assert res.returncode == 0, (name, res.stdout, res.stderr)
        (line,) = res.stdout.splitlines()
        # every op and event that was logged whole is checked, the later session's all
        assert line.startswith(f"identical: 2 session(s), {ops} ops, {events} events; "), (name, line)
        assert f"session 1 (line 1) cut off at line {second - 1} (a crash: " in line, (name, line)
        partial = cut != _cuts(text)["after the op line"] and cut != _cuts(text)["after a Committed line"]
        assert (f"a partial line {second - 1}" in line) == partial, (name, line)
        unfinished = name != "in the op line"  # cut inside its own line, the op itself was never logged whole
        assert ("Generate at line 6 unfinished, checked as far as logged" in line) == unfinished, (name, line)


def test_a_cut_line_the_next_header_extends_is_the_sessions_end(eng, tmp_path):
    """An older writer appended the restarted process's header to the cut line itself."""
    first, later = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    Session(eng, log=first).generate("Count to five.", seed=1, max_new_tokens=30)
    Session(eng, log=later).generate("And to six?", seed=2, max_new_tokens=30)
    text = first.read_text()
    for name, cut in _cuts(text).items():
        log = tmp_path / "joined.jsonl"
        log.write_bytes(text.encode()[:cut] + later.read_bytes())
        sessions = read_log(log)
        assert len(sessions) == 2 and len(sessions[1].steps) == 3, name
        same, line = replay(log, eng)
        assert same and "identical: 2 session(s)" in line and "session 1 (line 1) cut off at line" in line, (
            line
        )


def test_a_divergence_after_the_crash_still_exits_1(eng, tiny_a, tmp_path):
    log = tmp_path / "s.jsonl"
    Session(eng, log=log).generate("Count to five.", seed=1, max_new_tokens=30)
    log.write_bytes(log.read_bytes()[: _cuts(log.read_text())["in a Committed line"]])
    Session(eng, log=log).generate("And to six?", seed=2, max_new_tokens=30)
    lines = log.read_text().splitlines()
    i = max(i for i, line in enumerate(lines) if '"Replied"' in line)  # the later session's reply
    rec = json.loads(lines[i])
    rec["event"]["token_ids"][0] = (rec["event"]["token_ids"][0] + 1) % 1000
    lines[i] = json.dumps(rec)
    log.write_text("\n".join(lines) + "\n")
    res = _replay_cli(log, tiny_a)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert f"line {i + 1}: event" in res.stdout and "token_ids first differs at [0]" in res.stdout


def test_a_line_that_is_not_json_mid_session_is_still_refused(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"header": {}}\n{"op": {"type": "Pi\n{"op": {"type": "Ping"}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        read_log(log)
    log.write_text('{"header": {}}\n{"op": {"type": "Ping"}}\n{"op": {"type": "Pi\n')  # the end: a crash
    assert read_log(log)[0].partial == 3
