"""The README's lm-evaluation-harness recipe (issue #61 item 5): its demo block, run as written against a live
`diffgemma serve` on the bundled demo model, with only the venv, port and output directory filled in. lm-eval
lives in a venv of its own; set LM_EVAL_PYTHON to that venv's python (`python -m venv .lmeval &&
.lmeval/bin/pip install "lm-eval[api]"`) to run it, else the run is skipped, saying so. The task's own files
(docs/lm_eval/) are checked either way."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diffgemma.weights.download import bundled_model
from tests.live_server import free_port, stop, wait_up
from tests.test_readme import README, readme_blocks

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "docs" / "lm_eval"
LM_EVAL_PYTHON = os.environ.get("LM_EVAL_PYTHON")


def recipe_blocks() -> list[list[str]]:
    """Each lm_eval command of the README's recipe, its lines joined and split as the shell would."""
    out = []
    for block in readme_blocks(README.read_text()):
        text = block.text.replace("\\\n", " ")
        out += [shlex.split(ln) for ln in text.splitlines() if ln.startswith(".lmeval/bin/lm_eval ")]
    return out


def model_args(cmd: list[str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))


def demo_command() -> list[str]:
    (cmd,) = [c for c in recipe_blocks() if "docs/lm_eval" in c]
    return cmd


def test_the_recipe_uses_the_chat_route_with_text_requests():
    cmds = recipe_blocks()
    assert len(cmds) == 2  # the real model's and the demo's
    for cmd in cmds:
        assert cmd[cmd.index("--model") + 1] == "local-chat-completions" and "--apply_chat_template" in cmd
        args = model_args(cmd)
        assert re.fullmatch(r"http://127\.0\.0\.1:8080/v1/chat/completions", args["base_url"])
        assert args["tokenized_requests"] == "False" and int(args["num_concurrent"]) > 1
    assert model_args(demo_command())["model"] == "demo" == bundled_model().name  # the id serve reports


def test_the_demo_task_is_generate_only_with_its_dataset_beside_it():
    task = (TASK_DIR / "diffgemma_demo_arith.yaml").read_text()
    assert "output_type: generate_until" in task and "custom_dataset: !function demo_arith.load" in task
    rows = [json.loads(ln) for ln in (TASK_DIR / "demo_arith.jsonl").read_text().splitlines()]
    assert len(rows) >= 8
    for row in rows:  # every target is the question's arithmetic
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", row["question"]).groups()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)), row


@pytest.mark.skipif(
    not LM_EVAL_PYTHON,
    reason="LM_EVAL_PYTHON is not set: point it at the python of a venv with lm-eval[api] to run the recipe",
)
def test_the_readme_recipe_scores_the_demo_model_through_serve(tmp_path):
    lm_eval = Path(LM_EVAL_PYTHON).parent / "lm_eval"
    assert lm_eval.exists(), f"{lm_eval}: LM_EVAL_PYTHON's venv has no lm_eval (pip install 'lm-eval[api]')"
    port = free_port()
    log = tmp_path / "serve.log"
    serve = [sys.executable, "-m", "diffgemma.cli", "serve", "-m", str(bundled_model()), "--port", str(port)]
    with open(log, "w") as f:
        server = subprocess.Popen([*serve, "--log-dir", str(tmp_path / "logs")], stdout=f, stderr=f)
    try:
        wait_up(server, f"http://127.0.0.1:{port}", log=log)
        cmd = demo_command()
        cmd[0] = str(lm_eval)
        i = cmd.index("--model_args") + 1
        cmd[i] = cmd[i].replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        cmd[cmd.index("--output_path") + 1] = str(tmp_path / "out")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # the task downloads nothing
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        stop(server)
    (results,) = (tmp_path / "out").rglob("results_*.json")
    body = json.loads(results.read_text())
    assert body["n-samples"]["diffgemma_demo_arith"]["effective"] == 2  # --limit 2
    assert body["results"]["diffgemma_demo_arith"]["exact_match,last-number"] == 1.0  # as the README says
    served = [json.loads(ln) for ln in (tmp_path / "logs" / "requests.jsonl").read_text().splitlines()]
    assert len(served) == 2 and all(
        r["status"] == 200 and r["request"]["messages"][0]["role"] == "user" for r in served
    )
