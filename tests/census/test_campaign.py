"""A whole campaign on the demo model through the CLI (two arms, two prompts, two seeds): per-reply records and a
summary are written, `--analyze` reproduces the summary byte for byte with no model, and a gate fails on the arm
broken on purpose (DIFFGEMMA_MAX_DENOISING_STEPS=1) naming it and the metric. Plus the paired comparison's
arithmetic on hand-made records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffgemma.census import analyze as A
from diffgemma.census import batteries as B

ITEMS = [
    {"id": "add", "prompt": "What is 17 + 25?", "check": {"kind": "exact", "value": "17 + 25 = 42"}},
    {
        "id": "sub",
        "prompt": "Compute 40 - 7.",
        "check": [{"kind": "contains", "value": "33"}, {"kind": "stopped"}],
    },
    # a question schema, answered by scored reads: no denoise trace, a pass or not
    next(json.loads(line) for line in B.resolve("demo").read_text().splitlines() if '"schema-1"' in line),
    # ~16k tokens of the demo's tokenizer, beyond its 8,192 positions: an outcome, not a crash
    {"id": "far", "longctx": {"words": 6000, "depth": 0.5, "seed": 1}},
]


def _census(*args):
    return subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "census", *map(str, args)], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    d = tmp_path_factory.mktemp("census")
    (d / "tiny.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    (d / "arms.json").write_text(
        json.dumps([{"name": "base"}, {"name": "broken", "env": {"DIFFGEMMA_MAX_DENOISING_STEPS": "1"}}])
    )
    (d / "gate.json").write_text(json.dumps({"pass_rate": {"min": 0.0}, "steps_per_block": {"min": 1.5}}))
    p = _census(
        "--arms",
        d / "arms.json",
        "--battery",
        d / "tiny.jsonl",
        "--seeds",
        "0,1",
        "--out",
        d / "run",
        "--gate",
        d / "gate.json",
    )
    return d, p


def test_the_campaign_writes_records_and_a_summary_and_its_gate_fails_on_the_broken_arm(campaign):
    d, p = campaign
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[-1] == (
        "diffgemma: error: gate failed: arm 'broken': steps_per_block 1 is below the minimum 1.5"
    )
    assert "[16/16] arm broken" in p.stderr  # progress as it ran
    records = [json.loads(line) for line in (d / "run" / "records.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["id"], r["seed"]) for r in records] == [
        (arm, i, s) for arm in ("base", "broken") for s in (0, 1) for i in ("add", "sub", "schema-1", "far")
    ]
    base = records[0]
    assert (
        base["passed"] and base["outcome"] == "pass" and base["text"] == "17 + 25 = 42" and base["tokens"] > 0
    )
    assert all(r["steps_committed"] == r["blocks"] for r in records if r["arm"] == "broken")
    far = [r for r in records if r["id"] == "far"]
    assert all(r["outcome"] == "over_context" and "context of 8192" in r["detail"] for r in far)
    scored = [r for r in records if r["id"] == "schema-1"]
    assert all(
        r["finish_reason"] == "scored" and r["tokens"] == 0 and r["outcome"] in ("pass", "fail")
        for r in scored
    )
    summary = json.loads((d / "run" / "summary.json").read_text())
    assert summary["per_arm"]["base"]["overall"]["n"] == 8 and summary["vs_first"]["broken"]["pairs"] == 8
    assert summary["per_arm"]["broken"]["overall"]["steps_per_block"] == 1.0
    assert (d / "run" / "summary.txt").read_text() in p.stdout


def test_analyze_reproduces_the_summary_byte_for_byte_without_a_model(campaign):
    d, _ = campaign
    p = _census("--analyze", d / "run", "--out", d / "again", "--gate", d / "gate.json", "--model", "x")
    assert p.returncode == 2 and "takes no --arms, --battery or --model" in p.stderr
    gate = d / "loose.json"
    gate.write_text(json.dumps({"pass_rate": {"min": 0.0}}))
    p = _census("--analyze", d / "run", "--out", d / "again", "--gate", gate)
    assert p.returncode == 0, p.stderr
    for name in ("summary.json", "summary.txt"):
        assert (d / "again" / name).read_bytes() == (d / "run" / name).read_bytes()
    assert "reproduced byte for byte" in p.stderr and "gate passed" in p.stderr and "loaded" not in p.stderr
    p = _census(
        "--battery", "demo", "--out", d / "run"
    )  # a directory that holds a campaign is never mixed into
    assert p.returncode == 1 and "holds a campaign already" in p.stderr


def _records(arm, passed, contested):
    return [
        {
            "arm": arm, "battery": "b", "id": f"i{i}", "seed": 0, "passed": passed[i], "tokens": 100,
            "contested": contested[i], "hard": 0, "dup": 0, "blocks": 1, "steps_committed": 3, "steps_retry": 0,
            "steps_run": 3, "retries": 0, "seconds": 0.1, "cpu_seconds": 0.1,
        }
        for i in range(len(passed))
    ]  # fmt: skip


def test_the_paired_interval_is_zero_for_equal_arms_and_brackets_a_real_difference():
    n = 40
    base = _records("a", [i % 2 == 0 for i in range(n)], [i % 5 for i in range(n)])
    same = [{**r, "arm": "b"} for r in base]
    worse = _records("c", [i % 4 == 0 for i in range(n)], [i % 5 + 3 for i in range(n)])
    assert A.paired(base, same)["pass_rate"] == {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    d = A.paired(base, worse)
    assert d["pairs"] == n and d["pass_rate"]["diff"] == -0.25 and d["contested_per_1k"]["diff"] == 30.0
    assert d["pass_rate"]["lo"] <= -0.25 <= d["pass_rate"]["hi"] < 0  # a difference the interval resolves
    assert (
        d["contested_per_1k"]["lo"] == d["contested_per_1k"]["hi"] == 30.0
    )  # every pair differs by 3 tokens
    assert A.paired(base, worse) == d  # a fixed seed: the same records give the same interval
