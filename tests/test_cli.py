"""The command line end to end, through a subprocess, on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffgemma.testing import write_tiny_checkpoint

FAST = {"max_denoising_steps": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cli"), seed=1, generation=FAST)


def run(*args: str, stdin: str = "", env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("diffgemma: error:")]


def test_ask_streams_text_and_a_summary(model):
    proc = run("ask", "-m", str(model), "-p", "What is 17 + 25?", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # gibberish from random weights, but text
    assert f"model {model}" in proc.stderr
    assert "24 tokens" in proc.stderr and "blocks" in proc.stderr and "tok/s" in proc.stderr


def test_ask_json_reports_counts_and_timings(model):
    proc = run(
        "ask", "-m", str(model), "-p", "-", "--json", "--max-tokens", "20", "--seed", "7", stdin="hello there"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completion_tokens"] == len(out["token_ids"]) == 20
    assert out["blocks"] == 2 and out["steps"] >= 2 and out["prompt_tokens"] > 5
    for key in ("text", "reasoning", "tool_calls", "prefill_seconds", "denoise_seconds", "tok_s"):
        assert key in out
    again = json.loads(
        run(
            "ask", "-m", str(model), "-p", "hello there", "--json", "--max-tokens", "20", "--seed", "7"
        ).stdout
    )
    assert again["token_ids"] == out["token_ids"]  # same seed, same reply


def test_chat_second_turn_prefills_only_its_new_tokens(model):
    proc = run("chat", "-m", str(model), "--json", "--max-tokens", "12", stdin="first question\nsecond one\n")
    assert proc.returncode == 0, proc.stderr
    t1, t2 = (json.loads(line) for line in proc.stdout.splitlines())
    assert t1["reused_tokens"] == 0 and t1["prefilled_tokens"] == t1["prompt_tokens"]
    # Turn 2 reuses turn 1's prompt KV (less the empty thought channel the template strips from history).
    assert t2["reused_tokens"] >= t1["prompt_tokens"] - 4
    assert t2["prefilled_tokens"] == t2["prompt_tokens"] - t2["reused_tokens"]
    assert t2["prefilled_tokens"] < t2["prompt_tokens"] - t1["prompt_tokens"] + 5


def test_chat_commands(model):
    proc = run(
        "chat",
        "-m",
        str(model),
        "--json",
        "--max-tokens",
        "8",
        stdin="/seed 5\nhi\n/reset\nhi\n/bogus\n/quit\nnever\n",
    )
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(turns) == 2 and turns[1]["reused_tokens"] == 0  # /reset dropped the history and its KV
    assert turns[0]["token_ids"] == turns[1]["token_ids"]  # same seed and prompt after reset
    assert "seed 5" in proc.stderr and "unknown command" in proc.stderr


def test_prompt_renders_the_template(model):
    req = {"messages": [{"role": "user", "content": "hi"}], "enable_thinking": False}
    proc = run("prompt", "-m", str(model), stdin=json.dumps(req))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    assert out["ids"][:2] == [2, 105] and out["ids"][-1] == 101


def test_errors_are_one_line_and_nonzero(model, tmp_path):
    proc = run("ask", "-m", str(tmp_path / "missing"), "-p", "hi")
    assert proc.returncode == 1 and error_lines(proc) == [
        f"diffgemma: error: model directory {tmp_path / 'missing'} does not exist"
    ]

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{ not json")
    proc = run("ask", "-m", str(corrupt), "-p", "hi")
    assert proc.returncode == 1 and len(error_lines(proc)) == 1 and "config.json" in error_lines(proc)[0]

    proc = run("ask", "-m", str(model), "-p", "word " * 200, "--ctx", "64")
    assert (
        proc.returncode == 2
        and len(error_lines(proc)) == 1
        and "the context is 64 (--ctx)" in error_lines(proc)[0]
    )

    for command in (("ask", "-p", "hi"), ("chat",), ("serve",)):  # past the model's positions, before loading
        proc = run(*command, "-m", str(model), "--ctx", "200000")
        assert proc.returncode == 1 and len(error_lines(proc)) == 1, proc.stderr
        assert "beyond this model's 131072 positions" in error_lines(proc)[0]

    proc = run("ask", "-m", str(model), "-p", "hi", "--threads", "0")
    assert proc.returncode == 1 and error_lines(proc) == [
        "diffgemma: error: runtime config: threads must be at least 1, got 0"
    ]

    proc = run("prompt", "-m", str(model), stdin="{oops")
    assert proc.returncode == 2 and len(error_lines(proc)) == 1 and "not valid JSON" in error_lines(proc)[0]

    proc = run("prompt", "-m", str(model), stdin='{"messages": [{"role": "wizard", "content": "x"}]}')
    assert proc.returncode != 0 and len(error_lines(proc)) == 1 and "wizard" in error_lines(proc)[0]


def test_usage_errors_are_one_line_too(model):
    """Bad flags and arguments, caught by the parsers (typer's and the argparse commands'): one line, exit 2."""
    for args, msg in (
        (("ask", "-m", str(model)), "Missing option '-p' / '--prompt'."),
        (("serve", "--port", "abc"), "Invalid value for '--port'"),
        (("ask", "--bogus"), "No such option: --bogus"),
        (("nosuch",), "No such command 'nosuch'."),
        (("bench", "--reps", "3"), "--reps must be at least 10, got 3"),
        (("eval",), "Missing option '-m' / '--model'."),
    ):
        proc = run(*args)
        lines = error_lines(proc)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and len(lines) == 1, (args, proc.stderr)
        where = "diffgemma" if args[0] == "nosuch" else f"diffgemma {args[0]}"
        assert msg in lines[0] and f"(see `{where} --help`)" in lines[0]


def test_ctrl_c_cancels_the_reply_not_the_session(model):
    import os
    import signal
    import time

    env = {  # a reply that cannot end by itself: no stop tokens, every block its 48 steps
        **os.environ,
        "DIFFGEMMA_MAX_DENOISING_STEPS": "48",
        "DIFFGEMMA_ENTROPY_STOP": "0",
        "DIFFGEMMA_PLATEAU_STEPS": "0",
        "DIFFGEMMA_STOP_TOKEN_IDS": "",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffgemma.cli",
            "chat",
            "-m",
            str(model),
            "--json",
            "--max-tokens",
            "6000",
            "--ctx",
            "8192",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdin.write("write a very long story\n")
    proc.stdin.flush()
    assert proc.stderr.readline().startswith("diffgemma: model")  # imports done; loading the tiny model now
    time.sleep(4)  # loading and a few blocks: the reply is far from done
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    out, err = proc.communicate("/quit\n", timeout=120)
    assert proc.returncode == 0, err
    turn = json.loads(out.splitlines()[0])
    assert turn["finish_reason"] == "cancelled" and turn["completion_tokens"] < 6000
    assert "cancelled" in err and "Traceback" not in err


def test_train_and_eval_commands_exit_zero(tmp_path):
    out = tmp_path / "tiny"
    proc = run(
        "train", "--out", str(out), "--preset", "tiny", "--steps", "2", "--device", "cpu", "--eval-n", "0"
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists()
    proc = run("eval", "-m", str(out), "--n", "1", "--tasks", "arith", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "arith" in proc.stdout and "overall" in proc.stdout
