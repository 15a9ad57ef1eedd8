"""Grade a reply that should be a program: syntax-check it, run it on each fixture case in the sandbox, and
keep "it did not compile" apart from "it ran and printed the wrong thing".

The battery (assets/batteries/programmatic.jsonl) has one JSON object per line:

    {"id": "sum-args", "prompt": "Write a Python program that ...",
     "check": {"kind": "program", "language": "python",
               "cases": [{"args": ["2", "3"], "stdin": "", "stdout": "5", "exit_code": 0}, ...]}}

`id` is unique in the file; `prompt` asks for a bare program (no Markdown, no explanation); `check.language`
is "python" (run by the current interpreter, standard library only) or "bash"; each case gives the
command-line `args` (default none), `stdin` (default empty), the expected `stdout` and `exit_code` (default
0), and `check.timeout_s` (default 10) bounds each run. Outcomes:

- "no_program": nothing that reads as code (see `looks_like_code`) is left once a fence is taken off;
- "compile_fail": Python's `compile()` (in this process: it executes nothing) or `bash -n` (in the sandbox)
  rejects it;
- "wrong_output": a case ended other than by exiting (a timeout, a signal, the output cap), or its exit code
  or its stdout differs (compared after stripping trailing whitespace from each line and trailing newlines);
  after a timeout the remaining cases are not run (they count as failed: a hanging program would cost the
  timeout once per case);
- "pass": every case matched.

A reply in a Markdown fence is counted as disobeying (`fenced`) but is unwrapped (the first fenced block) and
still graded."""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass

from diffgemma.census.sandbox import LANGUAGES, PATH, RunResult, run_program

DEFAULT_TIMEOUT_S = 10.0
OUTCOMES = ("pass", "compile_fail", "wrong_output", "no_program")
_FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*$", re.MULTILINE)
# the first words of shell lines that are code whatever PATH holds: keywords, builtins, grouping
_SHELL_KEYWORDS = (
    "if then else elif fi for while until do done case esac function select in { } [ [[ ! ( (( . : source"
    " echo printf read local declare export readonly set unset shift return exit eval exec test cd pwd let"
    " trap wait true false mapfile readarray break continue"
)
_SHELL_WORDS = frozenset(_SHELL_KEYWORDS.split())


@dataclass(frozen=True)
class ProgramOutcome:
    """How a reply fared: `outcome` (one of OUTCOMES), whether it came fenced, how many cases passed out of
    how many, and a line on the first thing that went wrong."""

    outcome: str
    fenced: bool
    cases_passed: int
    cases: int
    detail: str


def grade_program(reply: str, check: dict) -> ProgramOutcome:
    """Grade `reply` against a "program" check (format in the module docstring)."""
    if not isinstance(reply, str):
        raise TypeError(f"reply must be a str, not {type(reply).__name__}")
    validate_check(check)
    language, cases = check["language"], check["cases"]
    timeout_s = float(check.get("timeout_s", DEFAULT_TIMEOUT_S))
    code, fenced = unwrap(reply)
    if not code.strip() or not looks_like_code(code, language):
        return ProgramOutcome("no_program", fenced, 0, len(cases), "nothing in the reply reads as a program")
    error = _syntax_error(code, language)
    if error:
        return ProgramOutcome("compile_fail", fenced, 0, len(cases), error)
    passed, first_failure = 0, ""
    for i, case in enumerate(cases):
        result = run_program(code, language, case.get("args", []), case.get("stdin", ""), timeout_s)
        failure = _case_failure(result, case)
        if not failure:
            passed += 1
            continue
        first_failure = first_failure or f"case {i}: {failure}"
        if result.status == "timeout":
            first_failure += f" (the {len(cases) - i - 1} later cases were not run)"
            break
    if passed == len(cases):
        return ProgramOutcome("pass", fenced, passed, len(cases), "")
    return ProgramOutcome("wrong_output", fenced, passed, len(cases), first_failure)


def unwrap(reply: str) -> tuple[str, bool]:
    """(the program, whether it was fenced): the first Markdown-fenced block if the reply has a fence (an
    unclosed one runs to the end), else the reply itself."""
    opening = _FENCE.search(reply)
    if not opening:
        return reply.strip("\n"), False
    rest = reply[opening.end() + 1 :]
    closing = _FENCE.search(rest)
    return (rest[: closing.start()] if closing else rest).strip("\n"), True


def looks_like_code(code: str, language: str) -> bool:
    """Whether some line of `code` reads as a statement of `language` rather than prose. Python: a line that
    parses alone (a block header completed by `pass`), other than a bare name or constant. Bash: a line whose
    first word is a shell keyword or builtin, an assignment, a function definition, or a command on PATH."""
    for line in code.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if language == "python" and _python_statement(text):
            return True
        if language == "bash" and _shell_command(text):
            return True
    return False


def _python_statement(text: str) -> bool:
    for attempt in (text, text + "\n    pass"):
        try:
            tree = ast.parse(attempt)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        return not all(
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Name | ast.Constant)
            for node in tree.body
        )
    return False


def _shell_command(text: str) -> bool:
    word = text.split()[0]
    if word in _SHELL_WORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=", word):
        return True
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*\(\)", word) or word.startswith(("$(", "((")):
        return True
    return shutil.which(word, path=PATH) is not None


def _syntax_error(code: str, language: str) -> str:
    """ "" when `code` is syntactically valid, else the first error in a line."""
    if language == "python":
        try:
            compile(code, "<reply>", "exec", dont_inherit=True)
        except SyntaxError as e:
            return f"line {e.lineno}: {e.msg}"
        except (ValueError, RecursionError, MemoryError, OverflowError) as e:
            return f"{type(e).__name__}: {e}"
        return ""
    # `bash -n` reads the program from stdin and parses it without running a command
    result = run_program("exec bash --norc --noprofile -n", "bash", stdin=code, timeout_s=DEFAULT_TIMEOUT_S)
    if result.status == "ok" and result.exit_code == 0:
        return ""
    if result.status != "ok":
        return f"bash -n did not finish: {result.status} ({result.detail})"
    return (
        result.stderr.strip().splitlines()[0] if result.stderr.strip() else f"bash -n exit {result.exit_code}"
    )


def _case_failure(result: RunResult, case: dict) -> str:
    """ "" when the run matches the case, else what differs."""
    if result.status != "ok":
        return f"{result.status}: {result.detail}"
    want = case.get("exit_code", 0)
    if result.exit_code != want:
        return f"exit code {result.exit_code}, expected {want} (stderr {_clip(result.stderr)})"
    got, expected = normalize_output(result.stdout), normalize_output(case["stdout"])
    if got != expected:
        return f"stdout {_clip(got)}, expected {_clip(expected)}"
    return ""


def normalize_output(text: str) -> str:
    """Trailing whitespace off each line, then trailing newlines off the whole."""
    return "\n".join(line.rstrip() for line in text.split("\n")).rstrip("\n")


def _clip(text: str, limit: int = 160) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def validate_check(check: object) -> None:
    """Raise ValueError (TypeError for a non-dict) naming what is wrong with a "program" check."""
    if not isinstance(check, dict):
        raise TypeError(f"check must be a dict, not {type(check).__name__}")
    if check.get("kind") != "program":
        raise ValueError(f"check kind must be 'program', not {check.get('kind')!r}")
    if check.get("language") not in LANGUAGES:
        raise ValueError(f"check language must be one of {LANGUAGES}, not {check.get('language')!r}")
    timeout = check.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60:
        raise ValueError(f"check timeout_s must be a number of seconds in (0, 60], not {timeout!r}")
    cases = check.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError("check cases must be a non-empty list")
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("stdout"), str):
            raise ValueError(f"case {i} must be an object with a str 'stdout'")
        unknown = set(case) - {"args", "stdin", "stdout", "exit_code"}
        if unknown:
            raise ValueError(f"case {i} has unknown keys {sorted(unknown)}")
        args = case.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"case {i} args must be a list of str")
        if not isinstance(case.get("stdin", ""), str):
            raise ValueError(f"case {i} stdin must be a str")
        code = case.get("exit_code", 0)
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
            raise ValueError(f"case {i} exit_code must be an int in [0, 255]")
