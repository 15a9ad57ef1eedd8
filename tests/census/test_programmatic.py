"""The programmatic grader and battery (issue #61 item 2): a reply is graded pass / compile_fail /
wrong_output / no_program, a fenced reply is flagged and still run, and every battery prompt's fixture cases
are passed by a reference solution and failed by a program that does nothing."""

from __future__ import annotations

import copy
import json

import pytest

from diffgemma.census import batteries
from diffgemma.census.programmatic import (
    grade_program,
    looks_like_code,
    normalize_output,
    unwrap,
    validate_check,
)

SUM_CHECK = {
    "kind": "program",
    "language": "python",
    "timeout_s": 5,
    "cases": [
        {"args": ["2", "3"], "stdout": "5"},
        {"args": [], "stdout": "0", "exit_code": 0},
        {"args": ["10", "-4"], "stdout": "6\n"},
    ],
}
SUM = "import sys\nprint(sum(int(a) for a in sys.argv[1:]))\n"
UPPER_CHECK = {
    "kind": "program",
    "language": "bash",
    "timeout_s": 5,
    "cases": [{"stdin": "ab\n", "stdout": "AB"}, {"stdin": "", "stdout": "", "exit_code": 0}],
}

# A reference solution for every battery prompt: the battery's expected outputs are right if these pass.
REFERENCE = {
    "py-sum-args": SUM,
    "py-reverse-lines": "import sys\nfor line in reversed(sys.stdin.read().splitlines()):\n    print(line)\n",
    "py-word-count": "import sys\nprint(len(sys.stdin.read().split()))\n",
    "py-fizzbuzz": (
        "import sys\nfor i in range(1, int(sys.argv[1]) + 1):\n"
        "    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)\n"
    ),
    "py-is-prime": (
        "import sys\nn = int(sys.argv[1])\n"
        "print('yes' if n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)) else 'no')\n"
    ),
    "py-parity-exit": "import sys\nsys.exit(int(sys.stdin.read()) % 2)\n",
    "py-letter-counts": (
        "import sys, collections\n"
        "c = collections.Counter(ch for ch in sys.stdin.read().lower() if 'a' <= ch <= 'z')\n"
        "for k in sorted(c):\n    print(k, c[k])\n"
    ),
    "py-json-keys": "import json, sys\nfor k in sorted(json.load(sys.stdin)):\n    print(k)\n",
    "py-caesar": (
        "import sys\nk = int(sys.argv[1])\nout = []\nfor ch in sys.stdin.read():\n"
        "    base = 65 if 'A' <= ch <= 'Z' else 97 if 'a' <= ch <= 'z' else None\n"
        "    out.append(ch if base is None else chr((ord(ch) - base + k) % 26 + base))\n"
        "print(''.join(out), end='')\n"
    ),
    "py-dedupe": "import sys\nfor line in dict.fromkeys(sys.stdin.read().splitlines()):\n    print(line)\n",
    "py-usage-error": (
        "import sys\nif len(sys.argv) != 3:\n    print('usage: prog A B', file=sys.stderr)\n    sys.exit(2)\n"
        "print(int(sys.argv[1]) * int(sys.argv[2]))\n"
    ),
    "sh-count-args": 'echo "$#"\n',
    "sh-upper": "tr 'a-z' 'A-Z'\n",
    "sh-sort-numbers": "sort -n\n",
    "sh-greet": (
        'if [ "$#" -eq 0 ]; then echo "Hello, world!"; fi\nfor n in "$@"; do echo "Hello, $n!"; done\n'
    ),
    "sh-exit-status": 'if [ "$1" = fail ]; then exit 3; fi\necho ok\n',
    "sh-line-lengths": 'while IFS= read -r line; do echo "${#line}"; done\n',
    "sh-max": 'm=$1\nfor n in "$@"; do if [ "$n" -gt "$m" ]; then m=$n; fi; done\necho "$m"\n',
}


def test_a_correct_python_program_passes():
    got = grade_program(SUM, SUM_CHECK)
    assert (got.outcome, got.fenced, got.cases_passed, got.cases) == ("pass", False, 3, 3), got


def test_a_correct_bash_program_passes():
    got = grade_program("tr a-z A-Z", UPPER_CHECK)
    assert (got.outcome, got.cases_passed, got.cases) == ("pass", 2, 2), got


def test_a_fenced_reply_is_flagged_and_still_run():
    for fence in ("```python\n", "```\n", "Here you go:\n```py\n"):
        got = grade_program(f"{fence}{SUM}```\nThat prints the sum.", SUM_CHECK)
        assert (got.outcome, got.fenced, got.cases_passed) == ("pass", True, 3), (fence, got)
    got = grade_program("```bash\ntr a-z A-Z\n```", UPPER_CHECK)
    assert (got.outcome, got.fenced) == ("pass", True), got


def test_a_syntax_error_is_compile_fail():
    got = grade_program("import sys\nprint(sum(int(a) for a in sys.argv[1:])\n", SUM_CHECK)
    assert (got.outcome, got.cases_passed) == ("compile_fail", 0) and "line" in got.detail, got
    got = grade_program('for f in *; do\n  echo "$f"\n', UPPER_CHECK)
    assert got.outcome == "compile_fail" and "syntax error" in got.detail, got


def test_bash_syntax_check_runs_nothing(tmp_path):
    # `bash -n` parses only: a command in a program that fails to parse is never run
    got = grade_program(f"touch {tmp_path}/ran\nif then", UPPER_CHECK)
    assert got.outcome == "compile_fail" and not (tmp_path / "ran").exists(), got


def test_wrong_output_counts_the_cases_passed():
    got = grade_program("import sys\nprint(5)\n", SUM_CHECK)
    assert (got.outcome, got.cases_passed, got.cases) == ("wrong_output", 1, 3), got
    assert got.detail.startswith("case 1: stdout '5', expected '0'"), got


def test_a_wrong_exit_code_is_wrong_output():
    got = grade_program(SUM + "raise SystemExit(1)\n", SUM_CHECK)
    assert (got.outcome, got.cases_passed) == ("wrong_output", 0) and "exit code 1" in got.detail, got
    got = grade_program("tr a-z A-Z; exit 2", UPPER_CHECK)
    assert got.outcome == "wrong_output" and "exit code 2" in got.detail, got


def test_a_hanging_program_is_wrong_output_and_stops_the_cases():
    check = copy.deepcopy(SUM_CHECK)
    check["timeout_s"] = 1
    got = grade_program("while True:\n    pass\n", check)
    assert (got.outcome, got.cases_passed) == ("wrong_output", 0), got
    assert "timeout" in got.detail and "2 later cases were not run" in got.detail, got


def test_a_crash_is_wrong_output():
    got = grade_program("import sys\nprint(1 / 0)\n", SUM_CHECK)
    assert got.outcome == "wrong_output" and "ZeroDivisionError" in got.detail, got


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "   \n\n",
        "```python\n```",
        "I'm sorry, I can't write that program.",
        "Sure!\nHere is how you would do it.",
    ],
)
def test_empty_or_prose_replies_are_no_program(reply):
    for check in (SUM_CHECK, UPPER_CHECK):
        got = grade_program(reply, check)
        assert (got.outcome, got.cases_passed, got.cases) == ("no_program", 0, len(check["cases"])), (
            reply,
            got,
        )


def test_looks_like_code_tells_code_from_prose():
    assert looks_like_code("x = 1", "python") and looks_like_code("for i in range(3):", "python")
    assert not looks_like_code("Here is the program that sums them.\nresult", "python")
    assert looks_like_code("sort -n", "bash") and looks_like_code("total=0", "bash")
    assert looks_like_code("while read -r x; do", "bash")
    assert not looks_like_code("The script sorts the numbers.\n# a comment", "bash")


def test_unwrap():
    assert unwrap("print(1)\n") == ("print(1)", False)
    assert unwrap("Text\n```python\nprint(1)\n```\nmore\n```\nprint(2)\n```") == ("print(1)", True)
    assert unwrap("```\nprint(1)\n") == ("print(1)", True)  # unclosed: to the end
    assert unwrap("~~~bash\necho hi\n~~~") == ("echo hi", True)


def test_normalize_output():
    assert normalize_output("a  \nb\t\n\n\n") == "a\nb"
    assert normalize_output("  lead\n") == "  lead"  # leading whitespace is kept


def test_bad_checks_are_refused():
    with pytest.raises(TypeError):
        grade_program(None, SUM_CHECK)
    with pytest.raises(TypeError):
        validate_check([])
    bad = [
        ({"kind": "exact"}, "kind"),
        ({"language": "perl"}, "language"),
        ({"cases": []}, "cases"),
        ({"cases": [{"args": ["1"]}]}, "stdout"),
        ({"cases": [{"stdout": "", "args": "1"}]}, "args"),
        ({"cases": [{"stdout": "", "exit_code": 300}]}, "exit_code"),
        ({"cases": [{"stdout": "", "expected": 1}]}, "unknown"),
        ({"timeout_s": 0}, "timeout_s"),
    ]
    for change, word in bad:
        with pytest.raises(ValueError, match=word):
            validate_check({**SUM_CHECK, **change})


def _battery_items():
    return batteries.load("programmatic").items


def test_the_battery_reads_and_mixes_languages():
    items = _battery_items()
    assert 12 <= len(items) <= 20
    assert all(
        isinstance(item.prompt, str) and [c["kind"] for c in item.checks] == ["program"] for item in items
    )
    languages = [item.checks[0]["language"] for item in items]
    assert languages.count("python") >= 5 and languages.count("bash") >= 5
    assert all(2 <= len(item.checks[0]["cases"]) <= 4 for item in items)
    assert sorted(item.id for item in items) == sorted(REFERENCE)


def test_every_battery_prompt_is_passed_by_its_reference_and_not_by_silence():
    for item in _battery_items():
        check = item.checks[0]
        got = grade_program(REFERENCE[item.id], check)
        assert got.outcome == "pass", (item.id, got)
        # a program that prints nothing and exits 0 must fail some case (checked without running one)
        silent = all(
            normalize_output(c["stdout"]) == "" and c.get("exit_code", 0) == 0 for c in check["cases"]
        )
        assert not silent, item.id


def test_a_bad_battery_line_is_named(tmp_path):
    lines = batteries.resolve("programmatic").read_text().splitlines()
    broken = json.loads(lines[1])
    broken["check"]["language"] = "cobol"
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(broken)]) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl line 2: .*check language"):
        batteries.load(str(path))
    path.write_text("\n".join([lines[0], lines[0]]) + "\n")
    with pytest.raises(ValueError, match=r" line 2: id .* used twice"):
        batteries.load(str(path))
