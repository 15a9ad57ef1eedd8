"""The README's examples run verbatim on the bundled demo model and give what the README says they give.

Every fenced ```sh / ```bash / ```python block of README.md runs, except one whose preceding line is a
`<!-- readme-test: skip (why) -->` marker (set-up, the real model, GPUs, the network, opencode). Shell blocks run
through bash with `diffgemma` on PATH as a shim for this checkout's `python -m diffgemma.cli`; Python blocks run
in a fresh interpreter; the block that talks to `127.0.0.1:8080` runs against a live `diffgemma serve` on a free
port. Where the README states a result, the test checks both that the README states it and that the run gives it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import diffgemma
from tests.live_server import free_port, stop, wait_up

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"^<!-- readme-test: skip \((?P<why>[^)]+)\) -->$")
RUNNABLE = {"sh": "shell", "bash": "shell", "python": "python"}
SERVER_URL = "127.0.0.1:8080"  # the README's address; the live server's block gets its real port
TIMEOUT = 180  # seconds a command: the demo answers in a few, so this only bounds a hang


@dataclass
class Block:
    """One fenced block of the README: its language, text, first line number and skip reason (None: it runs)."""

    lang: str
    text: str
    line: int
    skip: str | None

    @property
    def kind(self) -> str | None:
        return RUNNABLE.get(self.lang)

    def name(self) -> str:
        first = next(ln for ln in self.text.splitlines() if ln.strip() and not ln.startswith("#"))
        return f"L{self.line}:{first[:40]}"


def readme_blocks(text: str) -> list[Block]:
    """The README's fenced blocks, each with the skip marker on the nearest non-blank line above its fence."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        above = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        m = SKIP.match(above)
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        out.append(Block(lang, "\n".join(body) + "\n", start + 1, m["why"] if m else None))
        i += 1
    return out


TEXT = README.read_text()
FLAT = " ".join(TEXT.split())  # prose with its line breaks folded, to find a stated figure across a wrap
BLOCKS = readme_blocks(TEXT)
SHELL = [b for b in BLOCKS if b.kind == "shell" and b.skip is None]
PYTHON = [b for b in BLOCKS if b.kind == "python" and b.skip is None]


def stated(*phrases: str) -> None:
    """The README says each phrase (whitespace folded): a check of a result must be a check of a stated one."""
    for phrase in phrases:
        assert " ".join(phrase.split()) in FLAT, f"the README no longer says {phrase!r}"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment where `diffgemma` is this checkout's CLI and discovery finds the bundled demo model."""
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "diffgemma"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m diffgemma.cli "$@"\n')
    shim.chmod(0o755)
    src = str(Path(diffgemma.__file__).resolve().parents[1])
    e = {k: v for k, v in os.environ.items() if not k.startswith("DIFFGEMMA_")}  # no outer overrides
    e["PATH"] = f"{shim_dir}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = src + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    # An empty HF cache: a machine with the real model cached would otherwise discover it instead of the demo
    e["HF_HUB_CACHE"] = str(tmp_path / "hub")
    e["HF_HUB_OFFLINE"] = "1"
    return e


@dataclass
class Run:
    """One command (a line, or a whole block that cannot be split) and what it gave."""

    command: str
    rc: int
    stdout: str
    stderr: str


def commands(block: Block) -> list[str]:
    """A block's commands: its lines, or the whole block when a line does not stand alone (a here-document, a
    continued line, a quote left open)."""
    lines = [ln for ln in block.text.splitlines() if ln.strip()]
    whole = any("<<" in ln or ln.rstrip().endswith("\\") for ln in lines)
    if not whole:
        try:
            for ln in lines:
                shlex.split(ln, comments=True)
        except ValueError:
            whole = True
    return [block.text] if whole else lines


def bare(command: str) -> str:
    """A command line without its trailing comment (the README's commands hold no '#' of their own)."""
    return re.sub(r"\s+#\s.*$", "", command.strip()) if "\n" not in command.strip() else command


# What an interactive command reads on stdin when the test runs it: a question, then /quit.
STDIN = {"diffgemma chat": "What is 17 + 25?\n/quit\n"}


def run_shell(command: str, cwd: Path, env: dict[str, str]) -> Run:
    """Run one README command through bash, as a user pasting it would (errexit and pipefail on)."""
    p = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command],
        cwd=cwd,
        env=env,
        input=STDIN.get(bare(command), ""),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return Run(command, p.returncode, p.stdout, p.stderr)


def answers(stdout: str) -> dict[str, Any]:
    return json.loads(stdout)["answers"]


def labels(reply: dict[str, Any]) -> dict[str, str]:
    return {qid: a["label"] for qid, a in reply["answers"].items()}


def check_days_9(reply: dict[str, Any]) -> None:
    """The schema's first state: three sure answers in one read."""
    stated('late yes (0.99), city Paris (B, 1.00) and wait "7 days or more" (3, 1.00) in one read')
    a = reply["answers"]
    assert labels(reply) == {"late": "yes", "city": "B", "wait": "3"}, a
    assert a["city"]["choice"] == "Paris" and a["wait"]["level"] == "7 days or more", a
    got = [round(a[q]["confidence"], 2) for q in ("late", "city", "wait")]
    assert got == [0.99, 1.00, 1.00] and reply["diagnostics"]["samples"]["n"] == 1, reply


def check_days_6(reply: dict[str, Any]) -> None:
    """The schema's second state: an uncertain first read, so four reads."""
    stated(
        "the first read answers late no",
        "so it reads 4 times: late yes at 0.51 (agreement 0.5), wait 3 at 0.70 (agreement 1.0)",
    )
    a, samples = reply["answers"], reply["diagnostics"]["samples"]
    assert samples["n"] == 4 and samples["tops"][0] == ["no", "B", "3"], samples
    assert (a["late"]["label"], round(a["late"]["confidence"], 2), a["late"]["agreement"]) == (
        "yes",
        0.51,
        0.5,
    )
    assert (a["wait"]["label"], round(a["wait"]["confidence"], 2), a["wait"]["agreement"]) == ("3", 0.70, 1.0)


def check_score_block(run: Run) -> None:
    first, second = (json.loads(ln) for ln in run.stdout.splitlines())
    check_days_9(first)
    check_days_6(second)


def check_ask(run: Run) -> None:
    stated("streams the reply as blocks commit: 17 + 25 = 42")
    assert run.stdout.strip() == "17 + 25 = 42", run


def check_think(run: Run) -> None:
    stated("reasoning to stderr, the reply to stdout: 52 is larger.")
    assert run.stdout.strip() == "52 is larger.", run
    assert "Compare 37 and 52: 52 is larger." in run.stderr, run


def check_ask_json(run: Run) -> None:
    stated("one JSON object: text, reasoning, tool_calls, counts, timings")
    out = json.loads(run.stdout)
    assert out["text"] == "17 + 25 = 42" and out["reasoning"] == "" and out["tool_calls"] == [], out
    assert out["completion_tokens"] > 0 and out["prefill_seconds"] > 0 and out["denoise_seconds"] > 0, out


def check_chat(run: Run) -> None:
    assert "17 + 25 = 42" in run.stdout, run


def check_prompt(run: Run) -> None:
    stated("the rendered prompt and its ids")
    out = json.loads(run.stdout)
    assert "<|turn>user\nhi<turn|>" in out["text"] and out["ids"][0] == 2, out


def check_score_line(run: Run) -> None:
    check_days_9(json.loads(run.stdout))


def check_replay(run: Run) -> None:
    stated("journal the ops, re-execute and diff them: identical")
    assert run.stdout.splitlines()[-1].startswith("identical: 1 session(s)"), run


# The README's commands with a stated result, by their text (comment left out), each with its check. A command
# missing from the README fails the test: the README cannot drop or change an example without this table.
SHELL_CHECKS = {
    'diffgemma ask -p "What is 17 + 25?"': check_ask,
    'diffgemma ask --think -p "Which number is larger, 37 or 52?"': check_think,
    'echo "What is 17 + 25?" | diffgemma ask -p - --json': check_ask_json,
    "diffgemma chat": check_chat,
    """echo '{"messages": [{"role": "user", "content": "hi"}]}' | diffgemma prompt""": check_prompt,
    "diffgemma score --schema questions.json --state ticket.json": check_score_line,
    'diffgemma ask -p "hi" --log s.jsonl && diffgemma replay s.jsonl': check_replay,
    "cat > questions.json <<'EOF'": check_score_block,  # the schema block, by its first line
}


def check_key(command: str) -> str:
    return command.splitlines()[0] if "\n" in command.strip() else bare(command)


def test_the_readme_marks_only_what_cannot_run_on_a_cpu() -> None:
    """The markers name a reason, the examples this test checks are all unmarked, and the set-up is marked."""
    for b in BLOCKS:
        if b.skip is not None:
            assert b.kind is not None, f"line {b.line}: a skip marker on a block that would not run anyway"
    assert any("pip install" in b.text for b in BLOCKS) and not any("pip install" in b.text for b in SHELL)
    keys = {check_key(c) for b in SHELL for c in commands(b)}
    assert set(SHELL_CHECKS) <= keys, set(SHELL_CHECKS) - keys
    assert len(PYTHON) >= 3 and sum(SERVER_URL in b.text for b in PYTHON) == 1


def test_the_readmes_shell_examples(tmp_path: Path, env: dict[str, str]) -> None:
    """Every unmarked shell block, line by line, in one directory; the schema block first, as the command list
    names its files ("files below")."""
    work = tmp_path / "work"
    work.mkdir()
    order = sorted(SHELL, key=lambda b: "> questions.json" not in b.text)
    runs = [run_shell(c, work, env) for b in order for c in commands(b)]
    checked = set()
    for run in runs:
        assert run.rc == 0, f"{run.command!r} exited {run.rc}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        check = SHELL_CHECKS.get(check_key(run.command))
        if check is not None:
            check(run)
            checked.add(check_key(run.command))
    assert checked == set(SHELL_CHECKS)


def run_python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert p.returncode == 0, f"exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


def check_python_api(stdout: str, cwd: Path) -> None:
    stated("parsed reply: 17 + 25 = 42, no reasoning, []", "this forward's argmax: 17 + 25 = 42")
    assert stdout.splitlines() == ["17 + 25 = 42  []", "17 + 25 = 42"], stdout


def check_session(stdout: str, cwd: Path) -> None:
    assert stdout.splitlines() == ["17 + 25 = 42"], stdout
    assert (cwd / "chat.jsonl").stat().st_size > 0  # the journal the block asked for


PYTHON_CHECKS = {"eng.runner": check_python_api, "diffgemma.Session(": check_session}


@pytest.mark.parametrize("block", [b for b in PYTHON if SERVER_URL not in b.text], ids=Block.name)
def test_the_readmes_python_examples(block: Block, tmp_path: Path, env: dict[str, str]) -> None:
    """A Python block, verbatim, in a fresh interpreter; its stated results where it states them."""
    p = run_python(block.text, tmp_path, env)
    for key, check in PYTHON_CHECKS.items():
        if key in block.text:
            check(p.stdout, tmp_path)


def test_the_readmes_openai_client_against_a_live_server(tmp_path: Path, env: dict[str, str]) -> None:
    """The openai block against `diffgemma serve` on the demo model; then the server's side of the README's
    claims: the schema's figures equal `diffgemma score`'s (both seed 42), and json_object answers 422."""
    from openai import OpenAI, UnprocessableEntityError

    (block,) = [b for b in PYTHON if SERVER_URL in b.text]
    port = free_port()
    serve = subprocess.Popen(
        ["diffgemma", "serve", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_up(serve, f"http://127.0.0.1:{port}")
        p = run_python(block.text.replace(SERVER_URL, f"127.0.0.1:{port}"), tmp_path, env)
        stated("the demo: 17 + 25 = 42", "the demo streams its thought, then its reply: 52 is larger.")
        first, streamed = p.stdout.split("\n", 1)
        assert first.startswith("17 + 25 = 42 "), p.stdout  # then the cached-token count
        # the stream prints each delta as "reasoning content": the thought first, then the reply
        assert " ".join(streamed.split()) == "Compare 37 and 52: 52 is larger. 52 is larger.", p.stdout

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        schema = next(b for b in SHELL if "> questions.json" in b.text).text
        schema = schema.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[
            0
        ]  # the README's schema, as the block writes
        obj, model = json.loads(schema), client.models.list().data[0].id

        def ask(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
            system = json.dumps({**obj, **extra})
            messages = [{"role": "system", "content": system}, {"role": "user", "content": json.dumps(state)}]
            reply = client.chat.completions.create(model=model, messages=messages)
            return json.loads(reply.choices[0].message.content)

        state = {"item": "banana", "city": "Paris", "days": 9, "count": 14}
        stated("about `" + json.dumps(state) + "`", "The server gives the same figures")
        check_days_9(ask(state))
        check_days_6(ask({**state, "days": 6}))
        # the first read alone, whose figures the README states for the second state
        stated("late no (0.57) and wait 3 (0.70), both wrong and both uncertain")
        one = ask({**state, "days": 6}, samples=1)["answers"]
        got = {q: (one[q]["label"], round(one[q]["confidence"], 2)) for q in ("late", "wait")}
        assert got == {"late": ("no", 0.57), "wait": ("3", 0.70)}, one

        stated("The bundled demo model was never trained to write JSON, so there it always answers 422.")
        with pytest.raises(UnprocessableEntityError, match="valid JSON object after 3 attempts"):
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is 17 + 25?"}],
                response_format={"type": "json_object"},
            )
    finally:
        stop(serve)


def test_demo_model_names_the_bundled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """`diffgemma.demo_model()` is discovery's own bundled path; a build without one says so instead of a None."""
    from diffgemma.weights import download

    path = diffgemma.demo_model()
    assert path == download.bundled_model() and (path / "config.json").is_file()
    assert "demo_model" in diffgemma.__all__
    monkeypatch.setattr(download, "bundled_model", lambda: None)
    with pytest.raises(FileNotFoundError, match="no bundled demo model"):
        diffgemma.demo_model()
