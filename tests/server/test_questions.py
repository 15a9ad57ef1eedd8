"""The question-schema API on the server (the real block loop's model, the tiny checkpoint): scored reads, no text;
samples, auto reads, fix_definite and holes; the schema's prefix stays cached across states; a bad schema is a 400
naming its question; the op log replays."""

from __future__ import annotations

import json

import httpx
from typer.testing import CliRunner

from diffgemma.cli import app
from diffgemma.server import create_app
from tests.chat.test_questions import CHOICE, SCORE
from tests.server.conftest import CTX, ServerThread


def _ask(server, schema, state=None, **body):
    messages = [
        {"role": "system", "content": json.dumps(schema)},
        {"role": "user", "content": json.dumps(state or {"ticket": "The dashboard is blank after login."})},
    ]
    return httpx.post(server.base + "/v1/chat/completions", json={"messages": messages, **body}, timeout=60)


def test_a_schema_is_answered_by_reads_and_replays(engine, model_dir, tmp_path):
    log_dir = tmp_path / "logs"
    with ServerThread(create_app(engine, ctx=CTX, log_dir=log_dir)) as server:
        r = _ask(server, {"questions": [CHOICE, SCORE], "samples": 3}, seed=5)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 0
        out = json.loads(body["choices"][0]["message"]["content"])
        bucket, tone = out["answers"]["bucket"], out["answers"]["tone"]
        assert bucket["type"] == "choice" and bucket["choice"] in ("billing", "support", "engineering")
        assert set(bucket["probabilities"]) == {"billing", "support", "engineering"}
        for a in (bucket, tone):
            assert (
                abs(sum(a["probabilities"].values()) - 1) < 1e-5
                and a["stderr"] >= 0
                and 0 < a["agreement"] <= 1
            )
        assert 1 <= tone["score"] <= 3 and tone["level"] in SCORE["levels"]
        diag = out["diagnostics"]
        assert diag["samples"]["n"] == 3 and len(diag["samples"]["tops"]) == 3 and diag["hole"] == "noise"
        assert set(diag["questions"]["tone"]) == {"argmax_is_label", "entropy", "label_mass"}

        # another state: the schema's prefix is reused, only the state is prefilled
        again = json.loads(_ask(server, {"questions": [CHOICE, SCORE]}, {"ticket": "Refund please."}).json()
                           ["choices"][0]["message"]["content"])  # fmt: skip
        assert again["diagnostics"]["timing"]["reused_tokens"] > 50

        # auto: one read when every slot settles (a huge threshold), auto_max when one does not (threshold 0)
        one = json.loads(
            _ask(server, {"questions": [SCORE], "auto_threshold": 99}).json()["choices"][0]["message"][
                "content"
            ]
        )
        four = _ask(server, {"questions": [SCORE], "auto_threshold": 0, "auto_max": 4, "fix_definite": True})
        assert one["diagnostics"]["samples"]["n"] == 1
        assert json.loads(four.json()["choices"][0]["message"]["content"])["diagnostics"]["samples"]["n"] == 4
        for hole in ("pad", "label"):
            r = _ask(server, {"questions": [SCORE], "hole": hole, "samples": 1, "steps": 2})
            assert (
                r.status_code == 200
                and json.loads(r.json()["choices"][0]["message"]["content"])["diagnostics"]["hole"] == hole
            )

        bad = _ask(server, {"questions": [dict(SCORE, levels=["calm"])]})
        assert (
            bad.status_code == 400
            and "question 'tone': a score needs at least two levels" in bad.json()["error"]["message"]
        )
        chat = httpx.post(
            server.base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200  # ordinary chat is untouched
    res = CliRunner().invoke(app, ["replay", str(log_dir / "ops.jsonl"), "-m", str(model_dir)])
    assert res.exit_code == 0 and res.stdout.startswith("identical:"), res.output
    reads = [
        json.loads(line) for line in (log_dir / "ops.jsonl").read_text().splitlines() if '"Read"' in line
    ]
    assert len(reads) >= 3 + 1 + 1 + 4 + 2


def test_engine_score_and_the_cli_give_the_servers_answers_deterministically(engine, model_dir, tmp_path):
    schema = {"questions": [CHOICE, SCORE], "samples": 2}
    state = {"ticket": "Please refund my last invoice."}
    with ServerThread(create_app(engine, ctx=CTX)) as server:
        served = json.loads(_ask(server, schema, state, seed=3).json()["choices"][0]["message"]["content"])
    first = engine.score(schema, state, seed=3)
    again = engine.score(schema, state, seed=3)
    assert first["answers"] == again["answers"] == served["answers"]  # determinism at a fixed seed
    assert again["diagnostics"]["timing"]["reused_tokens"] > 0
    climbed = engine.score({**schema, "samples": 1, "climb": 2}, state, seed=3)
    c = climbed["diagnostics"]["climb"]  # two questions: one read each a round, from the first read's labels
    assert c["reads"] == 2 * c["rounds"] and 1 <= c["rounds"] <= 2
    assert c["ratified"] == (list(c["labels"].values()) == climbed["diagnostics"]["samples"]["tops"][0])
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "state.json").write_text(json.dumps(state))
    res = CliRunner().invoke(
        app, ["score", "--schema", str(tmp_path / "schema.json"), "--state", str(tmp_path / "state.json"),
              "-m", str(model_dir), "--seed", "3"],
    )  # fmt: skip
    assert res.exit_code == 0 and json.loads(res.stdout)["answers"].keys() == first["answers"].keys()
    (tmp_path / "bad.json").write_text(
        '{"questions": [{"id": "a", "type": "noul"}, {"id": "a", "type": "noul"}]}'
    )
    bad = CliRunner().invoke(
        app,
        [
            "score",
            "--schema",
            str(tmp_path / "bad.json"),
            "--state",
            str(tmp_path / "state.json"),
            "-m",
            str(model_dir),
        ],
    )
    assert bad.exit_code == 2 and "question 'a': duplicate id" in bad.stderr
