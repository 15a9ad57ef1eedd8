"""A battery item's checks: each a JSON object with a `kind`, validated when the battery loads (`validate`) and
applied to a reply (`grade`). An item's `check` is one such object or a list of them, all of which must pass.

kinds (fields):
- exact (value): the reply's text, stripped, equals value.
- contains / not_contains (value: a string or a list; ignore_case: bool): every / no value appears in the text.
- regex (pattern): re.search finds the pattern in the text.
- json (keys: optional list; equals: optional value): the stripped text parses as JSON (an object holding keys;
  equal to equals).
- max_words / min_words (n): the text has at most / at least n whitespace-separated words.
- stopped: the reply ended on a stop token (finish_reason "stop"), not on its budget.
- tool_call (name; arguments: optional object): the reply's first tool call has that name (and those arguments).
- reasoning_contains (value): the thought channel holds value.
- labels (labels: {question id: label}): a question schema's scored answers (the item's `schema` and `state`).
- needle (needle, document): long context: outcome pass when both appear, `needle_only` (the fast-prefill failure
  signature: the needle found, the document misread), `document_only`, or `neither`.
- program: the reply is a program run against fixture cases (`diffgemma.census.programmatic`); outcomes pass,
  compile_fail, wrong_output, no_program, and whether the reply was fenced."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "exact",
    "contains",
    "not_contains",
    "regex",
    "json",
    "max_words",
    "min_words",
    "stopped",
    "tool_call",
    "reasoning_contains",
    "labels",
    "needle",
    "program",
)


@dataclass
class Reply:
    """What the checks read of a reply."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (name, arguments)
    finish_reason: str = "stop"
    labels: dict[str, str] | None = None  # a question schema's answers


@dataclass
class Grade:
    passed: bool
    outcome: str  # "pass", "fail", or a kind's own failure (needle_only, compile_fail, ...)
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # a kind's own record fields (program: fenced, cases)


def _strings(check: dict[str, Any], key: str) -> list[str]:
    value = check.get(key)
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) for v in values):
        raise ValueError(f"check {check.get('kind')!r} needs {key!r}: a string or a list of strings")
    return values


def _int(check: dict[str, Any], key: str) -> int:
    value = check.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"check {check.get('kind')!r} needs {key!r}: a non-negative integer")
    return value


def validate(check: Any) -> None:
    """Raise ValueError naming what is wrong with one check object."""
    if not isinstance(check, dict) or not isinstance(check.get("kind"), str):
        raise ValueError('a check must be an object with a "kind"')
    kind = check["kind"]
    if kind not in KINDS:
        raise ValueError(f"unknown check kind {kind!r} (kinds: {', '.join(KINDS)})")
    if kind in ("exact", "contains", "not_contains", "reasoning_contains"):
        _strings(check, "value")
    elif kind == "regex":
        (pattern,) = _strings(check, "pattern")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"check 'regex': bad pattern {pattern!r}: {e}") from None
    elif kind == "json":
        if "keys" in check:
            _strings(check, "keys")
    elif kind in ("max_words", "min_words"):
        _int(check, "n")
    elif kind == "tool_call":
        _strings(check, "name")
        if not isinstance(check.get("arguments", {}), dict):
            raise ValueError("check 'tool_call': arguments must be an object")
    elif kind == "labels":
        labels = check.get("labels")
        if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("check 'labels' needs labels: an object of question id to label")
    elif kind == "needle":
        _strings(check, "needle")
        _strings(check, "document")
    elif kind == "program":
        from diffgemma.census.programmatic import validate_check

        try:
            validate_check(check)
        except TypeError as e:
            raise ValueError(str(e)) from None


def _fold(text: str, check: dict[str, Any]) -> str:
    return text.lower() if check.get("ignore_case") else text


def grade_one(check: dict[str, Any], reply: Reply) -> Grade:
    """Apply one validated check."""
    kind, text = check["kind"], reply.text
    if kind == "exact":
        ok = text.strip() == check["value"]
        return _verdict(ok, f"expected {check['value']!r}")
    if kind in ("contains", "not_contains"):
        hay = _fold(text, check)
        found = [v for v in _strings(check, "value") if _fold(v, check) in hay]
        if kind == "contains":
            missing = [v for v in _strings(check, "value") if v not in found]
            return _verdict(not missing, f"missing {missing!r}")
        return _verdict(not found, f"holds {found!r}")
    if kind == "regex":
        return _verdict(re.search(check["pattern"], text) is not None, f"no match for {check['pattern']!r}")
    if kind == "json":
        return _json(check, text.strip())
    if kind in ("max_words", "min_words"):
        n = len(text.split())
        ok = n <= check["n"] if kind == "max_words" else n >= check["n"]
        return _verdict(ok, f"{n} words")
    if kind == "stopped":
        return _verdict(reply.finish_reason == "stop", f"finish_reason {reply.finish_reason}")
    if kind == "tool_call":
        return _tool_call(check, reply)
    if kind == "reasoning_contains":
        return _verdict(check["value"] in reply.reasoning, f"reasoning lacks {check['value']!r}")
    if kind == "labels":
        got = reply.labels or {}
        wrong = sorted(q for q, label in check["labels"].items() if got.get(q) != label)
        return _verdict(not wrong, f"wrong labels {wrong}")
    if kind == "needle":
        needle, doc = check["needle"] in text, check["document"] in text
        outcome = (
            "pass" if needle and doc else "needle_only" if needle else "document_only" if doc else "neither"
        )
        return Grade(outcome == "pass", outcome, "" if outcome == "pass" else outcome)
    return _program(check, text)


def _verdict(ok: bool, why: str) -> Grade:
    return Grade(True, "pass") if ok else Grade(False, "fail", why)


def _json(check: dict[str, Any], text: str) -> Grade:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return Grade(False, "fail", "not JSON")
    keys = check.get("keys")
    if keys is not None:
        if not isinstance(value, dict):
            return Grade(False, "fail", "JSON, not an object")
        missing = [k for k in keys if k not in value]
        if missing:
            return Grade(False, "fail", f"JSON object lacks {missing}")
    if "equals" in check and value != check["equals"]:
        return Grade(False, "fail", "JSON of another value")
    return Grade(True, "pass")


def _tool_call(check: dict[str, Any], reply: Reply) -> Grade:
    if not reply.tool_calls:
        return Grade(False, "fail", "no tool call")
    name, args = reply.tool_calls[0]
    if name != check["name"]:
        return Grade(False, "fail", f"called {name!r}")
    if "arguments" in check and args != check["arguments"]:
        return Grade(False, "fail", f"arguments {json.dumps(args, sort_keys=True)}")
    return Grade(True, "pass")


def _program(check: dict[str, Any], text: str) -> Grade:
    from diffgemma.census.programmatic import grade_program  # the sandbox: imported when a battery needs it

    res = grade_program(text, check)
    extra = {"fenced": bool(res.fenced), "cases_passed": res.cases_passed, "cases": res.cases}
    return Grade(res.outcome == "pass", res.outcome, res.detail, extra)


def grade(checks: list[dict[str, Any]], reply: Reply) -> Grade:
    """All of an item's checks: the first failing one's grade (with every check's extra fields), else a pass."""
    extra: dict[str, Any] = {}
    first_fail: Grade | None = None
    for check in checks:
        g = grade_one(check, reply)
        extra.update(g.extra)
        if not g.passed and first_fail is None:
            first_fail = g
    result = first_fail or Grade(True, "pass")
    result.extra = extra
    return result
