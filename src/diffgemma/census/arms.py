"""Arms: what a census compares. An arms file is a JSON list (or JSONL, one object a line) of

    {"name": "int4", "env": {"DIFFGEMMA_SC_SPARSE": "0"}, "model": "PATH", "quantize": "int4"}

- name: unique, letters, digits, `-`, `_` and `.`.
- env: `DIFFGEMMA_*` overrides in environment form (string values), parsed by the same code as the process
  environment (`config.env_overrides`) and checked as a config (`SamplerConfig.validated`,
  `RuntimeConfig.validated`); they apply over the process environment, for this arm only.
- model: optional, a checkpoint or pack directory (default: the campaign's `--model`); a relative path is from the
  arms file's directory.
- quantize: optional, a pack profile (`diffgemma quantize --profile`): the arm runs a pack of its model in that
  profile, which the campaign writes into its output directory (`packs/NAME`) unless it is there already.

Everything is checked before any model loads: a bad arm raises ConfigError naming it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffgemma.config import (
    API_KEY_ENV,
    ENV_PREFIX,
    ConfigError,
    RuntimeConfig,
    SamplerConfig,
    env_overrides,
)

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_KEYS = {"name", "env", "model", "quantize"}


@dataclass(frozen=True)
class Arm:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    model: Path | None = None  # None: the campaign's model
    quantize: str | None = None  # a pack profile to run the model in
    sampler: dict[str, Any] = field(default_factory=dict)  # the env's SamplerConfig overrides, parsed
    runtime: dict[str, Any] = field(default_factory=dict)  # and its RuntimeConfig ones

    def describe(self) -> dict[str, Any]:
        """The arm as the campaign records it (JSON)."""
        return {
            "name": self.name,
            "env": dict(self.env),
            "model": None if self.model is None else str(self.model),
            "quantize": self.quantize,
        }


def default_arm() -> Arm:
    """The one arm of a campaign given no arms file: the model as it is."""
    return Arm("base")


def resolve(name: str) -> Path:
    """An arms file by path, or a bundled one by NAME (`assets/batteries/NAME_arms.json`: `demo`)."""
    from diffgemma.census.batteries import bundled_dir

    bundled = bundled_dir() / f"{name}_arms.json"
    return bundled if not Path(name).exists() and "/" not in name and bundled.is_file() else Path(name)


def read(path: str | Path) -> list[Arm]:
    """Parse and check an arms file, a path or a bundled NAME (ConfigError in one line naming the file, the arm
    and what is wrong)."""
    path = resolve(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"arms file {path}: {e.strerror or e}") from None
    try:
        stripped = text.strip()
        if stripped.startswith("["):
            objs = json.loads(stripped)
        else:
            objs = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ConfigError(f"arms file {path}: not JSON or JSONL: {e.msg} (line {e.lineno})") from None
    if not objs:
        raise ConfigError(f"arms file {path} holds no arms")
    arms: list[Arm] = []
    for i, obj in enumerate(objs):
        arm = parse(obj, path.parent, f"arms file {path}", i + 1)
        if any(a.name == arm.name for a in arms):
            raise ConfigError(f"arms file {path}: arm name {arm.name!r} is used twice")
        arms.append(arm)
    return arms


def parse(obj: Any, base: Path, source: str = "arms", index: int = 1) -> Arm:
    """The `index`th arm object of `source` (what errors name it by); `base`: where relative model paths start."""
    where = f"{source}, arm {index}"
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: an arm must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: name must be a string of letters, digits, '-', '_' or '.', got {name!r}")
    where = f"{source}, arm {name!r}"
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (keys: {', '.join(sorted(_KEYS))})")
    env = obj.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ConfigError(
            f'{where}: env must be an object of string values, e.g. {{"DIFFGEMMA_SC_SPARSE": "0"}}'
        )
    bad = next((k for k in env if not k.startswith(ENV_PREFIX) or k == API_KEY_ENV), None)
    if bad is not None:
        raise ConfigError(f"{where}: {bad} is not a {ENV_PREFIX}* config variable")
    try:  # the environment's own parser, then the configs' own range checks
        sampler, runtime = env_overrides("sampler", env), env_overrides("runtime", env)
        SamplerConfig(**sampler).validated()
        RuntimeConfig(**runtime).validated()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    model = obj.get("model")
    path: Path | None = None
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}: model must be a path string")
        path = check_model(base / Path(model).expanduser(), where)
    quantize = obj.get("quantize")
    if quantize is not None:
        from diffgemma.quant.profiles import QuantSpecError, resolve

        if not isinstance(quantize, str):
            raise ConfigError(f"{where}: quantize must be a profile name")
        try:
            resolve(quantize)
        except QuantSpecError as e:
            raise ConfigError(f"{where}: {e}") from None
    return Arm(name, dict(env), path, quantize, sampler, runtime)


def check_model(path: Path, where: str) -> Path:
    """A model or pack directory that exists and holds a config.json."""
    if not path.is_dir():
        raise ConfigError(f"{where}: model {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: model {path} has no config.json")
    return path
