"""Arms are checked before any model loads: a typo'd variable, a bad value, a value out of range, a missing model
path or an unknown pack profile is refused naming the arm (in Python a ConfigError; on the CLI one line, exit 1,
no model loaded and no campaign directory made)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffgemma.census import arms as A
from diffgemma.config import ConfigError


def _write(tmp_path, arms, name="arms.json"):
    path = tmp_path / name
    path.write_text(json.dumps(arms))
    return path


def test_a_good_arms_file_parses_through_the_environments_parser(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    arms = A.read(
        _write(
            tmp_path,
            [
                {"name": "base"},
                {"name": "dense", "env": {"DIFFGEMMA_SC_SPARSE": "off", "DIFFGEMMA_THREADS": "2"}},
                {"name": "pack", "model": "m", "quantize": "int4"},
            ],
        )
    )
    assert [a.name for a in arms] == ["base", "dense", "pack"]
    assert arms[1].sampler == {"sc_sparse": False} and arms[1].runtime == {"threads": 2}
    assert arms[2].model == tmp_path / "m" and arms[2].quantize == "int4"
    jsonl = tmp_path / "arms.jsonl"
    jsonl.write_text('{"name": "a"}\n{"name": "b", "env": {"DIFFGEMMA_ENTROPY_STOP": "0"}}\n')
    assert A.read(jsonl)[1].sampler == {"entropy_stop": 0.0}


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        (
            {"name": "typo", "env": {"DIFFGEMMA_SC_SPARSEE": "0"}},
            "unknown environment variable DIFFGEMMA_SC_SPARSEE",
        ),
        ({"name": "badval", "env": {"DIFFGEMMA_MAX_DENOISING_STEPS": "many"}}, "is not a valid int"),
        ({"name": "range", "env": {"DIFFGEMMA_MAX_DENOISING_STEPS": "0"}}, "max_denoising_steps must be > 0"),
        ({"name": "rt", "env": {"DIFFGEMMA_KERNELS": "turbo"}}, "kernels must be one of"),
        ({"name": "nonstr", "env": {"DIFFGEMMA_SC_SPARSE": 0}}, "string values"),
        ({"name": "other", "env": {"HOME": "/"}}, "HOME is not a DIFFGEMMA_"),
        ({"name": "nopack", "model": "missing-pack"}, "is not a directory"),
        ({"name": "prof", "quantize": "int3"}, "unknown profile 'int3'"),
        ({"name": "keys", "modle": "x"}, "unknown keys ['modle']"),
    ],
)
def test_a_bad_arm_is_refused_naming_it(tmp_path, arm, message):
    with pytest.raises(ConfigError) as e:
        A.read(_write(tmp_path, [{"name": "fine"}, arm]))
    assert message in str(e.value) and f"arm {arm['name']!r}" in str(e.value)


def test_the_bundled_demo_arms_compare_the_packs_and_the_sampler_levers():
    arms = A.read("demo")
    assert [(a.name, a.quantize) for a in arms[:3]] == [("bf16", None), ("int4", "int4"), ("fp8", "fp8")]
    assert [a.sampler for a in arms[3:]] == [{"sc_sparse": False}, {"entropy_stop": 0.0}]


def test_names_must_be_unique_and_well_formed(tmp_path):
    with pytest.raises(ConfigError, match="used twice"):
        A.read(_write(tmp_path, [{"name": "a"}, {"name": "a"}]))
    with pytest.raises(ConfigError, match="arm 2: name must be"):
        A.read(_write(tmp_path, [{"name": "a"}, {"name": "a b"}]))


def test_the_cli_refuses_a_typod_arm_in_one_line_before_loading(tmp_path):
    arms = _write(tmp_path, [{"name": "fine"}, {"name": "typo", "env": {"DIFFGEMMA_ENTROPY_STOPP": "0"}}])
    out = tmp_path / "campaign"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffgemma.cli",
            "census",
            "--arms",
            str(arms),
            "--battery",
            "demo",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffgemma: error: ") and "arm 'typo'" in lines[0]
    assert (
        "DIFFGEMMA_ENTROPY_STOPP" in lines[0] and not out.exists()
    )  # nothing ran: no directory, no model line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--battery", "demo", "--battery", "demo"], "two batteries of one name"),
        (["--battery", "demo", "--seeds", "1,x"], "--seeds must be comma-separated integers"),
    ],
)
def test_the_cli_refuses_bad_usage_before_loading(tmp_path, args, message):
    out = tmp_path / "campaign"
    p = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "census", *args, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr and not out.exists()
