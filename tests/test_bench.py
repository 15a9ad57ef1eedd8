"""`diffgemma bench` on CPU at a tiny shape: the JSON it writes, side by side with transformers (fp32)."""

from __future__ import annotations

import json

import pytest

from diffgemma.bench import main

pytest.importorskip("transformers")


def test_bench_tiny_writes_both_engines_and_the_check(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "64", "--reps", "10"]
    assert main([*args, "--gen-steps", "2", "--compare-hf", "--check-hf", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for engine in ("diffgemma", "transformers"):
        assert data[engine]["denoise_step_ms"]["64"] > 0 and data[engine]["prefill_tok_s"]["64"] > 0
        assert data[engine]["generate_256_s"] > 0
    check = data["check_hf"]["end_to_end"]
    for case in ("no_sc", "sc"):  # fp32 at a tiny shape: the same logits, the same argmax on every row
        assert check[case]["max_abs_diff"] < 1e-4 and check[case]["argmax_agreement"] == 1.0


@pytest.mark.parametrize("flag", ["--reps", "--gen-reps"])
def test_bench_refuses_fewer_than_ten_reps(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--tiny", "--device", "cpu", flag, "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"diffgemma: error: {flag} must be at least 10, got 3" in err


def test_bench_defaults_and_help():
    from diffgemma.bench import CONTEXTS, TINY_CONTEXTS, parse_args

    assert parse_args(["--tiny"]).contexts == TINY_CONTEXTS and parse_args([]).contexts == CONTEXTS
    assert parse_args(["--tiny", "--contexts", "64"]).contexts == "64"
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", "--help"], capture_output=True, text=True
    )
    assert "optionally against transformers on the very same weights" in " ".join(out.stdout.split())


def test_compare_hf_without_transformers_fails_before_measuring(tmp_path):
    import os
    import subprocess
    import sys

    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", "--tiny", "--compare-hf"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "need transformers: pip install 'diffgemma[test]'" in proc.stderr and "ctx" not in proc.stderr
