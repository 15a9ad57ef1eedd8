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


def test_help_and_the_errors_found_before_loading_do_not_import_torch(model, tmp_path):
    """`import diffgemma`, the help and the errors found before a model loads skip torch's import (over a second
    of CPU each: the package's torch-backed names load on first use)."""
    show = "import sys; print('torch' in sys.modules)"
    run_cli = "import runpy, sys\ntry:\n    runpy.run_module('diffgemma.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
    for code, args in (
        ("import diffgemma\n", ()),
        (run_cli, ("--help",)),
        (run_cli, ("ask", "-m", str(tmp_path / "missing"), "-p", "hi")),
        (run_cli, ("serve", "-m", str(model), "--port", "99999")),
    ):
        proc = subprocess.run([sys.executable, "-c", code + show, *args], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "False", (
            args,
            proc.stdout,
            proc.stderr,
        )
    proc = subprocess.run(  # and the names that need it load it when used
        [sys.executable, "-c", f"import diffgemma; diffgemma.load; {show}"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


def test_ctrl_c_cancels_the_reply_not_the_session(model):
    import os
    import signal
    import time

    env = {  # a reply that cannot end by itself: no stop tokens nor pad blocks, every block its 48 steps
        **os.environ,
        "DIFFGEMMA_PAD_BLOCK_STOP": "0",
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


def one_error_line(proc) -> str:
    """The only stderr line of a failed command: `diffgemma: error: ...`, no traceback."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffgemma: error: "), proc.stderr
    return lines[0]


def test_bad_devices_ports_and_input_files_are_one_line(model, tmp_path):
    import torch

    array, state, broken = tmp_path / "array.json", tmp_path / "state.json", tmp_path / "broken.json"
    array.write_text("[1, 2]")
    state.write_text('{"item": "apple"}')
    broken.write_text("{oops")
    m = ("-m", str(model))
    cases = [
        (("ask", *m, "-p", "hi", "--device", "tpu"), "unknown device 'tpu'"),
        (("ask", *m, "-p", "hi", "--device", "cuda:x"), "unknown device 'cuda:x'"),
        (("chat", *m, "--device", "meta"), "device 'meta' is not supported"),
        (("serve", *m, "--port", "99999"), "--port must be 0 to 65535, got 99999"),
        (("serve", *m, "--device", "tpu"), "unknown device 'tpu'"),
        (("score", *m, "--schema", str(array), "--state", str(state)), "is a JSON object, not an array"),
        (("score", *m, "--schema", str(broken), "--state", str(state)), f"--schema {broken}: Expecting"),
        (("score", *m, "--schema", str(state), "--state", str(tmp_path / "no.json")), "No such file"),
        (("score", *m, "--schema", str(tmp_path), "--state", str(state)), "Is a directory"),
        (("ask", *m, "-p", "hi", "--log", str(tmp_path)), f"--log {tmp_path} is a directory"),
        (("ask", "-m", str(state), "-p", "hi"), "is not a directory"),
    ]
    if not torch.backends.cuda.is_built():  # the case: a CPU-only torch
        cases.append((("ask", *m, "-p", "hi", "--device", "cuda"), "built without CUDA"))
    else:
        cases.append((("ask", *m, "-p", "hi", "--device", "cuda:99"), "cuda:99"))
    if not torch.backends.mps.is_available():
        cases.append((("ask", *m, "-p", "hi", "--device", "mps"), "device 'mps'"))
    for args, message in cases:
        assert message in one_error_line(run(*args)), args


def test_serve_refuses_a_taken_port_before_loading(model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(run("serve", "-m", str(model), "--port", str(port)))
    assert line.startswith(f"diffgemma: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in line


def test_the_python_api_checks_its_arguments(model):
    import diffgemma

    engine = diffgemma.load(model, "cpu", max_tokens=512)
    schema = {"questions": [{"id": "late", "type": "noul", "instructions": "Late?"}]}
    with pytest.raises(TypeError, match=r"schema must be a dict .* got str: parse it first"):
        engine.score(json.dumps(schema), {"days": 3})
    with pytest.raises(TypeError, match="schema must be a dict"):
        engine.score([schema], {"days": 3})
    with pytest.raises(TypeError, match="state must be JSON-serializable"):
        engine.score(schema, {"when": object()})
    with pytest.raises(TypeError, match="seed must be an int, got str"):
        engine.score(schema, {}, seed="1")
    for kwargs, error, message in (
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be at least 1, got 0"),
        ({"max_new_tokens": "8"}, TypeError, "max_new_tokens must be an int or None, got str"),
        ({"seed": 1.5}, TypeError, "seed must be an int, got float"),
        ({"logprobs": -1}, ValueError, "logprobs must be at least 0"),
        ({"sampler": {}}, TypeError, "sampler must be a SamplerConfig"),
    ):
        with pytest.raises(error, match=message):
            engine.generate("hi", **kwargs)
    with pytest.raises(ValueError, match=r"token id 5000 is outside this model's vocabulary \(0 to 1023\)"):
        engine.generate([2, 5000])
    with pytest.raises(TypeError, match="prompt must be token ids"):
        engine.generate(3)
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        diffgemma.load(model / "config.json")
    with pytest.raises(TypeError, match="path must be a model directory"):
        diffgemma.load(None)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        diffgemma.load(model, max_tokens=0)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        diffgemma.load(model, device="tpu")
    pick = {"questions": [{"id": "kind", "type": "choice", "options": [{"name": "fruit"}, {"name": "tool"}]}]}
    assert engine.score(pick, "a string state is JSON too")["answers"]["kind"]["label"] in ("A", "B")


class Terminal:
    """`diffgemma chat` on a pseudo-terminal, as a user at a shell runs it (stdin a TTY: the prompt, Ctrl-C)."""

    def __init__(self, model) -> None:
        import os
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal and stdin/stdout/stderr
            # Ctrl-C as a shell's child gets it: pytest-xdist's workers ignore SIGINT, and an ignored SIGINT is
            # inherited (Python then installs no KeyboardInterrupt handler)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, "-m", "diffgemma.cli", "chat", "-m", str(model)])
        self.seen = ""

    def shows(self, text: str, timeout: float) -> bool:
        """Whether `text` appears (after what earlier calls consumed) within `timeout` seconds; consumes nothing."""
        import os
        import select
        import time

        end = time.monotonic() + timeout
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return False
            try:
                chunk = os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # EIO: the child has closed the terminal
                chunk = ""
            assert chunk, f"chat ended before {text!r}; the terminal shows {self.seen!r}"
            self.seen += chunk
        return True

    def expect(self, text: str, timeout: float = 120) -> str:
        """Read until `text` has appeared (after what earlier calls consumed); returns what was read."""
        assert self.shows(text, timeout), f"no {text!r} within {timeout} s; the terminal shows {self.seen!r}"
        upto = self.seen.index(text) + len(text)
        read, self.seen = self.seen[:upto], self.seen[upto:]
        return read

    def send(self, text: str) -> None:
        import os

        os.write(self.fd, text.encode())

    def exit_code(self, timeout: float = 60) -> int:
        """The child's exit status once it ends, what it printed last kept in `self.seen`."""
        import contextlib
        import os
        import select
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if select.select([self.fd], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:  # what it wrote last may still wait in the terminal
                while select.select([self.fd], [], [], 0.2)[0]:
                    try:
                        chunk = os.read(self.fd, 4096)
                    except OSError:
                        break
                    if not chunk:
                        break
                    self.seen += chunk.decode(errors="replace")
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit; the terminal shows {self.seen!r}")


def test_chat_ctrl_c_at_the_prompt_does_not_quit_and_a_bad_seed_says_why(model):
    import os
    import signal
    import time

    term = Terminal(model)
    term.expect(">>> ")
    # readline writes the prompt before it waits on the terminal: a SIGINT between the two only sets Python's flag
    # and the wait goes on until a key comes (a person is never that quick). So let it reach the wait first, and
    # on a loaded machine, where it may not have, press Ctrl-C again: a SIGINT during the wait ends it.
    time.sleep(1.0)
    for _ in range(12):
        os.kill(term.pid, signal.SIGINT)  # Ctrl-C at the idle prompt
        if term.shows("/quit or Ctrl-D", 5.0):
            break
    assert "/quit or Ctrl-D" in term.expect(">>> ")  # a new prompt: the REPL is still there
    term.send("/seed abc\n")
    assert "/seed takes an integer, got 'abc'; the seed stays 42" in term.expect(">>> ")
    term.send("/seed 7\n")
    assert "seed 7" in term.expect(">>> ")
    term.send("/quit\n")
    assert term.exit_code() == 0


def test_chat_ctrl_d_ends_the_prompts_line(model):
    term = Terminal(model)
    term.expect(">>> ")
    term.send("\x04")  # Ctrl-D at an empty line: end of input
    assert term.exit_code() == 0
    assert term.seen.startswith("\r\n")  # the shell's prompt then starts on a line of its own
