"""The Gemma 4 tool-call argument grammar: Python values <-> `{key:<|"|>text<|"|>,n:3}` text.

Strings are wrapped in the `<|"|>` delimiter token (no escaping inside), object keys are bare (or, in tool
declarations, delimiter-wrapped) and sorted case-insensitively, and any other scalar is written the way
Python's `str()` writes it, as the Gemma 4 chat template does (so `None`, not `null`). The parser accepts both
spellings of the constants so that it reads what a model writes as well as what the template writes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_CONSTANTS: dict[str, Any] = {
    "true": True,
    "True": True,
    "false": False,
    "False": False,
    "null": None,
    "None": None,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
}
_CONSTANT_RE = re.compile("|".join(sorted((re.escape(k) for k in _CONSTANTS), key=len, reverse=True)))


def sorted_items(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """Items ordered as Jinja's `dictsort` orders them: by key, case-insensitively, stable."""
    return sorted(mapping.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def format_value(obj: Any, escape_keys: bool = False) -> str:
    """Write a Python value in the tool-call grammar (what the Gemma 4 template emits for it)."""
    if isinstance(obj, str):
        return QUOTE + obj + QUOTE
    if isinstance(obj, bool):
        return "true" if obj else "false"
    if isinstance(obj, Mapping):
        parts = []
        for key, value in sorted_items(obj):
            k = QUOTE + str(key) + QUOTE if escape_keys else str(key)
            parts.append(f"{k}:{format_value(value, escape_keys)}")
        return "{" + ",".join(parts) + "}"
    if isinstance(obj, list | tuple):
        return "[" + ",".join(format_value(item, escape_keys) for item in obj) + "]"
    return str(obj)


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """`call:NAME{...}`: the body of a `<|tool_call>` block."""
    return "call:" + name + format_value(arguments)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"tool-call value: {what} at offset {self.pos} in {self.text!r}")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def peek(self, s: str) -> bool:
        return self.text.startswith(s, self.pos)

    def expect(self, s: str) -> None:
        self.skip_ws()
        if not self.peek(s):
            raise self.error(f"expected {s!r}")
        self.pos += len(s)

    def string(self) -> str:
        self.pos += len(QUOTE)
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise self.error("unterminated string")
        s = self.text[self.pos : end]
        self.pos = end + len(QUOTE)
        return s

    def key(self) -> str:
        self.skip_ws()
        if self.peek(QUOTE):
            return self.string()
        end = self.text.find(":", self.pos)
        key = self.text[self.pos : end].strip() if end >= 0 else ""
        if not key or any(c in key for c in "{}[],"):
            raise self.error("expected an object key")
        self.pos = end
        return key

    def value(self) -> Any:
        self.skip_ws()
        if self.peek(QUOTE):
            return self.string()
        if self.peek("{"):
            return self.obj()
        if self.peek("["):
            return self.array()
        m = _CONSTANT_RE.match(self.text, self.pos)
        if m:
            self.pos = m.end()
            return _CONSTANTS[m.group()]
        m = _NUMBER.match(self.text, self.pos)
        if m:
            self.pos = m.end()
            tok = m.group()
            return float(tok) if any(c in tok for c in ".eE") else int(tok)
        raise self.error("expected a value")

    def obj(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.skip_ws()
        if self.peek("}"):
            self.pos += 1
            return out
        while True:
            key = self.key()
            self.expect(":")
            out[key] = self.value()
            self.skip_ws()
            if self.peek(","):
                self.pos += 1
            elif self.peek("}"):
                self.pos += 1
                return out
            else:
                raise self.error("expected ',' or '}'")

    def array(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.skip_ws()
        if self.peek("]"):
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            self.skip_ws()
            if self.peek(","):
                self.pos += 1
            elif self.peek("]"):
                self.pos += 1
                return out
            else:
                raise self.error("expected ',' or ']'")

    def end(self) -> None:
        self.skip_ws()
        if self.pos != len(self.text):
            raise self.error("trailing text")


def parse_value(text: str) -> Any:
    """Inverse of `format_value`; raises ValueError on malformed text."""
    reader = _Reader(text)
    value = reader.value()
    reader.end()
    return value


def parse_call(text: str) -> tuple[str, dict[str, Any]]:
    """Parse `call:NAME{...}` into (name, arguments); raises ValueError on malformed text."""
    body = text.strip()
    if not body.startswith("call:"):
        raise ValueError(f"tool call must start with 'call:': {text!r}")
    brace = body.find("{")
    if brace < 0:
        raise ValueError(f"tool call has no argument object: {text!r}")
    name = body[len("call:") : brace].strip()
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"tool call has no valid name: {text!r}")
    reader = _Reader(body)
    reader.pos = brace
    args = reader.obj()
    reader.end()
    return name, args
