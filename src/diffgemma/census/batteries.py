"""Batteries: JSONL files of prompts with checkable outcomes, bundled in `diffgemma/assets/batteries/NAME.jsonl`
or given by path. One JSON object a line (blank lines and lines starting with `//` are skipped):

    {"id": "arith-17+25", "prompt": "What is 17 + 25?", "check": {"kind": "contains", "value": "42"}}

- id: unique within the battery.
- prompt: a string (one user turn), or messages: an OpenAI-style list; tools: optional list of tool schemas;
  think: optional bool (thinking on); max_tokens: optional reply budget (default the model's).
- check: one check object or a list of them (`census.checks`, which documents the kinds).
- schema + state instead of a prompt: a question schema answered by scored reads (`Engine.score`), with a
  `labels` check; such an item has no denoise trace.
- longctx instead of a prompt: {"words": N, "depth": D, "seed": S}: a deterministic haystack document of about N
  words (`census.longctx`) with a corpus-unique needle at depth D in [0, 1], and a question about both; its check
  is the generated `needle` check."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from diffgemma.census import checks as C
from diffgemma.census import longctx


def bundled_dir() -> Path:
    return Path(str(resources.files("diffgemma"))) / "assets" / "batteries"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in bundled_dir().glob("*.jsonl"))


@dataclass
class Item:
    id: str
    prompt: str | list[dict[str, Any]] | None
    checks: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    think: bool = False
    max_tokens: int | None = None
    schema: dict[str, Any] | None = None
    state: Any = None


@dataclass
class Battery:
    name: str
    path: Path
    items: list[Item] = field(default_factory=list)


def resolve(name: str) -> Path:
    """A bundled battery's file by NAME, or a path to a JSONL file."""
    bundled = bundled_dir() / f"{name}.jsonl"
    if "/" not in name and not name.endswith(".jsonl") and bundled.is_file():
        return bundled
    path = Path(name).expanduser()
    if path.is_file():
        return path
    raise ValueError(
        f"unknown battery {name!r}: neither a bundled one ({', '.join(bundled_names())}) nor a file"
    )


def load(name: str) -> Battery:
    """Load and validate a battery (ValueError naming the file and line of the first bad item)."""
    path = resolve(name)
    battery = Battery(path.stem, path)
    seen: set[str] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        try:
            item = _item(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"battery {path} line {n}: not JSON: {e.msg}") from None
        except ValueError as e:
            raise ValueError(f"battery {path} line {n}: {e}") from None
        if item.id in seen:
            raise ValueError(f"battery {path} line {n}: id {item.id!r} is used twice")
        seen.add(item.id)
        battery.items.append(item)
    if not battery.items:
        raise ValueError(f"battery {path} holds no items")
    return battery


_KEYS = {"id", "prompt", "messages", "tools", "think", "max_tokens", "check", "schema", "state", "longctx"}


def _item(obj: Any) -> Item:
    if not isinstance(obj, dict):
        raise ValueError("an item must be a JSON object")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown} (keys: {', '.join(sorted(_KEYS))})")
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise ValueError('an item needs an "id" string')
    sources = [k for k in ("prompt", "messages", "schema", "longctx") if k in obj]
    if len(sources) != 1:
        raise ValueError(f"item {item_id!r} needs exactly one of prompt, messages, schema, longctx")
    if "longctx" in obj:
        prompt, check = longctx.build(obj["longctx"])
        obj = {**obj, "prompt": prompt, "check": check}
    raw_checks = obj.get("check")
    item_checks = raw_checks if isinstance(raw_checks, list) else [raw_checks]
    for check in item_checks:
        try:
            C.validate(check)
        except ValueError as e:
            raise ValueError(f"item {item_id!r}: {e}") from None
    prompt = obj.get("prompt", obj.get("messages"))
    if "prompt" in obj and not isinstance(prompt, str):
        raise ValueError(f"item {item_id!r}: prompt must be a string")
    if "messages" in obj and not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
        raise ValueError(f"item {item_id!r}: messages must be a list of objects")
    tools, think, max_tokens = obj.get("tools"), obj.get("think", False), obj.get("max_tokens")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"item {item_id!r}: tools must be a list")
    if not isinstance(think, bool):
        raise ValueError(f"item {item_id!r}: think must be true or false")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ValueError(f"item {item_id!r}: max_tokens must be a positive integer")
    schema = obj.get("schema")
    if schema is not None:
        if not isinstance(schema, dict) or "state" not in obj:
            raise ValueError(f"item {item_id!r}: schema must be an object, with a state beside it")
        if [c["kind"] for c in item_checks] != ["labels"]:
            raise ValueError(f"item {item_id!r}: a schema item's check is one labels check")
    return Item(item_id, prompt, item_checks, tools, think, max_tokens, schema, obj.get("state"))
