"""Gates: a bad gate file is refused naming the file and the key (before any model loads); thresholds apply to
every arm, overall or per battery, and a failure names the arm and the metric."""

from __future__ import annotations

import json

import pytest

from diffgemma.census import gate as G
from diffgemma.config import ConfigError


def _summary(**per_arm):
    return {
        "arms": [{"name": n} for n in per_arm],
        "per_arm": {n: {"overall": o, "batteries": {"demo": b}} for n, (o, b) in per_arm.items()},
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"pass_rat": {"min": 0.5}}, "unknown metric 'pass_rat'"),
        ({"pass_rate": {"minimum": 0.5}}, "pass_rate needs"),
        ({"pass_rate": {"min": "high"}}, "pass_rate needs"),
        ({}, "expected an object"),
    ],
)
def test_a_bad_gate_file_is_refused(tmp_path, spec, message):
    path = tmp_path / "gate.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=message):
        G.read(path)


def test_failures_name_the_arm_and_the_metric(tmp_path):
    path = tmp_path / "gate.json"
    path.write_text(
        json.dumps(
            {"pass_rate": {"min": 0.5}, "demo/contested_per_1k": {"max": 40}, "x/dup_per_1k": {"max": 1}}
        )
    )
    spec = G.read(path)
    good = ({"pass_rate": 0.9, "dup_per_1k": 0}, {"pass_rate": 0.9, "contested_per_1k": 3.0})
    bad = ({"pass_rate": 0.4, "dup_per_1k": 0}, {"pass_rate": 0.4, "contested_per_1k": 41.0})
    assert G.failures(_summary(a=good, b=bad), spec) == [
        "arm 'a': x/dup_per_1k: the campaign ran no battery 'x'",
        "arm 'b': pass_rate 0.4 is below the minimum 0.5",
        "arm 'b': demo/contested_per_1k 41 is above the maximum 40",
        "arm 'b': x/dup_per_1k: the campaign ran no battery 'x'",
    ]
    del spec["x/dup_per_1k"]
    assert G.failures(_summary(a=good), spec) == []
