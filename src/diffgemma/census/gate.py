"""Acceptance gates: a JSON object of thresholds per metric, each {"min": x} and/or {"max": y}, checked on every
arm's summary. A key is a metric (`census.metrics.METRICS`, over all of an arm's batteries) or BATTERY/METRIC (one
battery's), e.g. {"pass_rate": {"min": 0.5}, "contested_per_1k": {"max": 40}, "demo/pass_rate": {"min": 0.9}}."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from diffgemma.census.metrics import METRICS
from diffgemma.config import ConfigError


def read(path: str | Path) -> dict[str, dict[str, float]]:
    """Parse and check a gate file (ConfigError naming the file and the bad key), before any model loads."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"gate file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"gate file {path}: not JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f'gate file {path}: expected an object such as {{"pass_rate": {{"min": 0.5}}}}')
    for key, bounds in spec.items():
        metric = key.rsplit("/", 1)[-1]
        if metric not in METRICS:
            raise ConfigError(f"gate file {path}: unknown metric {metric!r} (metrics: {', '.join(METRICS)})")
        ok = isinstance(bounds, dict) and bounds and set(bounds) <= {"min", "max"}
        if not ok or not all(_number(v) for v in bounds.values()):
            raise ConfigError(f'gate file {path}: {key} needs {{"min": NUMBER}} and/or {{"max": NUMBER}}')
    return spec


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def failures(summary: dict[str, Any], spec: dict[str, dict[str, float]]) -> list[str]:
    """Each (arm, threshold) the summary breaks, as "arm 'NAME': METRIC VALUE is below the minimum X"."""
    out = []
    for arm in (a["name"] for a in summary["arms"]):
        per = summary["per_arm"][arm]
        for key, bounds in spec.items():
            battery, _, metric = key.rpartition("/")
            if battery and battery not in per["batteries"]:
                out.append(f"arm {arm!r}: {key}: the campaign ran no battery {battery!r}")
                continue
            value = (per["batteries"][battery] if battery else per["overall"])[metric]
            if "min" in bounds and value < bounds["min"]:
                out.append(f"arm {arm!r}: {key} {value:.4g} is below the minimum {bounds['min']}")
            if "max" in bounds and value > bounds["max"]:
                out.append(f"arm {arm!r}: {key} {value:.4g} is above the maximum {bounds['max']}")
    return out
