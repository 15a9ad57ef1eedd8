"""A campaign's summary from its directory alone (no model, no GPU): per arm and battery the metrics
(`census.metrics`), the outcomes, the time; and each arm against the first one, paired on (battery, item, seed),
with a 95% confidence interval from a paired bootstrap of fixed seed, so that the same records always give the
same bytes. The campaign writes its summary with this code, from records.jsonl as read back: `--analyze DIR`
reproduces it byte for byte."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from diffgemma.census.metrics import COUNTS, METRICS, metrics

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 61  # fixed: a re-analysis draws the same resamples
DIGITS = 6  # the summary's floats are rounded, so that the JSON carries no summation noise


def read(campaign_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(campaign.json, the records) of a campaign directory (ValueError when either is missing or bad)."""
    d = Path(campaign_dir)
    if not d.is_dir():
        raise ValueError(f"{d} is not a campaign directory")
    try:
        meta = json.loads((d / "campaign.json").read_text(encoding="utf-8"))
        lines = (d / "records.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise ValueError(f"{d} is not a campaign directory: {Path(e.filename).name} is missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{d}/campaign.json is not JSON: {e.msg}") from None
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{d}/records.jsonl line {n} is not JSON (an interrupted campaign?)") from None
    if not records:
        raise ValueError(f"{d}/records.jsonl holds no records")
    return meta, records


def _round(values: dict[str, float]) -> dict[str, float]:
    return {k: round(float(v), DIGITS) for k, v in values.items()}


def _block(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "n": len(records),
        **_round(metrics(records)),
        "seconds": round(sum(r["seconds"] for r in records), 3),
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in records), 3),
    }


def _counts(records: list[dict[str, Any]]) -> np.ndarray:
    return np.array([[int(r[k]) for k in COUNTS] + [int(bool(r["passed"]))] for r in records], dtype=np.int64)


def _metric_row(row: np.ndarray, n: int) -> dict[str, float]:
    s = dict(zip((*COUNTS, "passed"), (int(v) for v in row), strict=True))
    return {name: f(s, n) for name, f in METRICS.items()}


def paired(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Every metric's difference other - base over their common (battery, id, seed) keys, with a 95% paired
    bootstrap interval (the keys resampled with replacement, both arms' records together)."""
    key = lambda r: (r["battery"], r["id"], r["seed"])  # noqa: E731
    a, b = {key(r): r for r in base}, {key(r): r for r in other}
    common = sorted(set(a) & set(b))
    if not common:
        return {"pairs": 0}
    ca, cb = _counts([a[k] for k in common]), _counts([b[k] for k in common])
    n = len(common)
    point_a, point_b = _metric_row(ca.sum(0), n), _metric_row(cb.sum(0), n)
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    sa, sb = ca[idx].sum(1), cb[idx].sum(1)  # [resamples, counts]
    draws = {name: np.empty(BOOTSTRAP_RESAMPLES) for name in METRICS}
    for i in range(BOOTSTRAP_RESAMPLES):
        ma, mb = _metric_row(sa[i], n), _metric_row(sb[i], n)
        for name in METRICS:
            draws[name][i] = mb[name] - ma[name]
    out: dict[str, Any] = {"pairs": n}
    for name in METRICS:
        lo, hi = np.percentile(draws[name], [2.5, 97.5])
        out[name] = _round({"diff": point_b[name] - point_a[name], "lo": lo, "hi": hi})
    return out


def summarize(meta: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    arms = [a["name"] for a in meta["arms"]]
    batteries = [b["name"] for b in meta["batteries"]]
    by_arm = {arm: [r for r in records if r["arm"] == arm] for arm in arms}
    per_arm = {}
    for arm, recs in by_arm.items():
        per_arm[arm] = {
            "overall": _block(recs),
            "batteries": {b: _block([r for r in recs if r["battery"] == b]) for b in batteries},
            "outcomes": dict(sorted(Counter(r["outcome"] for r in recs).items())),
        }
        fenced = [r["fenced"] for r in recs if "fenced" in r]
        if fenced:
            per_arm[arm]["fenced_rate"] = round(sum(fenced) / len(fenced), DIGITS)
    vs_first = {arm: paired(by_arm[arms[0]], by_arm[arm]) for arm in arms[1:]}
    return {
        "model": meta["model"],
        "arms": meta["arms"],
        "batteries": meta["batteries"],
        "seeds": meta["seeds"],
        "records": len(records),
        "per_arm": per_arm,
        "vs_first": vs_first,
    }


def table(summary: dict[str, Any]) -> str:
    """The arms side by side: each metric overall and each battery's pass rate; after the first arm, each one's
    difference from it with its 95% interval."""
    arms = [a["name"] for a in summary["arms"]]
    # (label, battery or None for overall, field, metric whose interval follows or None)
    rows: list[tuple[str, str | None, str, str | None]] = [("replies", None, "n", None)]
    rows += [(name, None, name, name) for name in METRICS]
    rows += [(f"{b['name']} pass_rate", b["name"], "pass_rate", None) for b in summary["batteries"]]
    rows += [("cpu seconds", None, "cpu_seconds", None)]
    head = [f"{'metric':<24}"] + [f"{arm:>30}" if i else f"{arm:>10}" for i, arm in enumerate(arms)]
    lines = ["".join(head)]
    for label, battery, field, ci in rows:
        cells = [f"{label:<24}"]
        for i, arm in enumerate(arms):
            per = summary["per_arm"][arm]
            value = (per["overall"] if battery is None else per["batteries"][battery])[field]
            text = f"{value:.4g}"
            if i and ci is not None and summary["vs_first"][arm].get("pairs"):
                d = summary["vs_first"][arm][ci]
                same = d["diff"] == d["lo"] == d["hi"] == 0
                text += " (=)" if same else f" {d['diff']:+.3g} [{d['lo']:+.3g}, {d['hi']:+.3g}]"
            cells.append(f"{text:>30}" if i else f"{text:>10}")
        lines.append("".join(cells))
    lines.append(
        f"(difference from {arms[0]} [95% paired bootstrap interval over battery x item x seed, "
        f"{BOOTSTRAP_RESAMPLES} resamples]; (=): zero in every resample)"
    )
    return "\n".join(lines) + "\n"


def dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2) + "\n"


def report(campaign_dir: str | Path, write_to: str | Path | None = None) -> dict[str, Any]:
    """The summary of a campaign directory; with `write_to`, summary.json and summary.txt written there."""
    summary = summarize(*read(campaign_dir))
    if write_to is not None:
        out = Path(write_to)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(dumps(summary), encoding="utf-8")
        (out / "summary.txt").write_text(table(summary), encoding="utf-8")
    return summary
