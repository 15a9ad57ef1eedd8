"""Batteries: every check kind passes what it should and fails what it should; the bundled batteries load; a bad
line is refused naming its file and line; the long-context prompts are deterministic with a unique needle."""

from __future__ import annotations

import json
import sys
import types

import pytest

from diffgemma.census import batteries as B
from diffgemma.census import checks as C
from diffgemma.census import longctx, programmatic


def _g(check, **reply):
    C.validate(check)
    return C.grade([check], C.Reply(**reply))


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        ({"kind": "exact", "value": "42"}, {"text": " 42\n"}, {"text": "42."}),
        ({"kind": "contains", "value": ["a", "b"]}, {"text": "b a"}, {"text": "a"}),
        ({"kind": "contains", "value": "PARIS", "ignore_case": True}, {"text": "paris"}, {"text": "rome"}),
        ({"kind": "not_contains", "value": "x"}, {"text": "abc"}, {"text": "xyz"}),
        ({"kind": "regex", "pattern": "^\\d+$"}, {"text": "123"}, {"text": "12a"}),
        ({"kind": "json", "keys": ["a"], "equals": {"a": 1}}, {"text": '{"a": 1}'}, {"text": '{"a": 2}'}),
        ({"kind": "json"}, {"text": "[1]"}, {"text": "```json\n[1]\n```"}),
        ({"kind": "max_words", "n": 2}, {"text": "one two"}, {"text": "one two three"}),
        ({"kind": "min_words", "n": 2}, {"text": "one two"}, {"text": "one"}),
        ({"kind": "stopped"}, {"finish_reason": "stop"}, {"finish_reason": "length"}),
        (
            {"kind": "tool_call", "name": "f", "arguments": {"x": 1}},
            {"tool_calls": [("f", {"x": 1})]},
            {"tool_calls": [("f", {"x": 2})]},
        ),
        ({"kind": "reasoning_contains", "value": "so"}, {"reasoning": "and so on"}, {"reasoning": ""}),
        ({"kind": "labels", "labels": {"q1": "yes"}}, {"labels": {"q1": "yes"}}, {"labels": {"q1": "no"}}),
    ],
)
def test_each_check_kind_passes_and_fails(check, good, bad):
    assert _g(check, **good).passed and _g(check, **good).outcome == "pass"
    g = _g(check, **bad)
    assert not g.passed and g.outcome == "fail" and g.detail


def test_needle_keeps_its_outcomes_apart():
    check = {"kind": "needle", "needle": "1234-KQX", "document": "Osprey"}
    assert [_g(check, text=t).outcome for t in ("1234-KQX; Osprey", "1234-KQX; Halcyon", "Osprey", "")] == [
        "pass", "needle_only", "document_only", "neither",
    ]  # fmt: skip


def test_program_checks_go_to_the_programmatic_grader(monkeypatch):
    seen = {}

    def grade_program(reply, check):
        seen["args"] = (reply, check)
        return types.SimpleNamespace(
            outcome="wrong_output", fenced=True, cases_passed=1, cases=2, detail="case 2"
        )

    stub = types.SimpleNamespace(grade_program=grade_program, validate_check=programmatic.validate_check)
    monkeypatch.setitem(sys.modules, "diffgemma.census.programmatic", stub)
    check = {"kind": "program", "language": "python", "cases": [{"stdin": "", "stdout": "1\n"}]}
    g = _g(check, text="print(1)")
    assert seen["args"] == ("print(1)", check)
    assert (g.passed, g.outcome, g.extra) == (
        False,
        "wrong_output",
        {"fenced": True, "cases_passed": 1, "cases": 2},
    )


def test_all_of_an_items_checks_must_pass():
    checks = [{"kind": "contains", "value": "a"}, {"kind": "max_words", "n": 1}]
    assert C.grade(checks, C.Reply(text="a")).passed
    g = C.grade(checks, C.Reply(text="a b"))
    assert not g.passed and g.detail == "2 words"


def test_bundled_batteries_load():
    assert {"demo", "smoke", "longctx"} <= set(B.bundled_names())
    demo = B.load("demo")
    kinds = {c["kind"] for item in demo.items for c in item.checks}
    assert {"exact", "tool_call", "labels", "reasoning_contains"} <= kinds and len(demo.items) >= 30
    assert len(B.load("smoke").items) == 17
    assert all(item.checks[0]["kind"] == "needle" for item in B.load("longctx").items)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a", "prompt": "x", "check": {"kind": "nope"}}', "unknown check kind 'nope'"),
        ('{"id": "a", "prompt": "x", "check": {"kind": "regex", "pattern": "("}}', "bad pattern"),
        ('{"id": "a", "prompt": "x", "chek": {"kind": "stopped"}}', "unknown keys ['chek']"),
        ('{"id": "a", "check": {"kind": "stopped"}}', "exactly one of prompt"),
        ('{"id": "a", "prompt": "x", "max_tokens": 0, "check": {"kind": "stopped"}}', "max_tokens"),
        ("not json", "not JSON"),
    ],
)
def test_a_bad_line_is_refused_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "b.jsonl"
    path.write_text('{"id": "ok", "prompt": "x", "check": {"kind": "stopped"}}\n' + line + "\n")
    with pytest.raises(ValueError, match="line 2") as e:
        B.load(str(path))
    assert message in str(e.value) and str(path) in str(e.value)


def test_duplicate_ids_and_unknown_names_are_refused(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "check": {"kind": "stopped"}}\n' * 2)
    with pytest.raises(ValueError, match="used twice"):
        B.load(str(path))
    with pytest.raises(ValueError, match="neither a bundled one"):
        B.load("no_such_battery")


def test_longctx_prompts_are_deterministic_with_a_unique_needle_at_its_depth():
    spec = {"words": 800, "depth": 0.25, "seed": 3}
    prompt, check = longctx.build(spec)
    assert longctx.build(dict(spec)) == (prompt, check)
    assert prompt.count(check["needle"]) == 1 and prompt.count(check["document"]) > 10
    log = prompt.split("\n\n")[1].split("\n")
    at = next(i for i, line in enumerate(log) if check["needle"] in line)
    assert abs(at / len(log) - 0.25) < 0.02 and len(" ".join(log).split()) >= 800
    deeper, other = longctx.build({**spec, "depth": 0.75}), longctx.build({**spec, "seed": 4})
    assert deeper[0] != prompt and other[1]["needle"] != check["needle"]
    with pytest.raises(ValueError, match="depth"):
        longctx.build({"words": 800, "depth": 2})
    assert json.dumps(check)  # a check the record can hold
