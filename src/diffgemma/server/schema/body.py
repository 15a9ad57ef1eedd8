"""The raw body: plain JSON (no NaN or Infinity), valid Unicode, at most MAX_DEPTH levels deep."""

from __future__ import annotations

import json
from typing import Any

from diffgemma.server.errors import invalid

MAX_DEPTH = 64  # nesting levels of a request body: deeper is refused before anything walks it


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise invalid("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise invalid(f"request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object", code="invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than MAX_DEPTH or holding a string that is not valid Unicode (a lone
    surrogate, which JSON's \\u escapes can spell), naming where. Iterative: depth costs no stack."""
    todo: list[tuple[Any, str, int]] = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"request body is nested deeper than {MAX_DEPTH} levels (at {where})", param=where)
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key.encode(
                    "utf-8", "backslashreplace"
                ).decode()  # printable even when it is not Unicode
                path = f"{where}.{name}" if where else name
                _check_text(key, path)
                todo.append((item, path, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"U+{ord(text[exc.start]):04X}"
        raise invalid(f"{where} is not valid Unicode text (a lone surrogate {bad})", param=where) from None
