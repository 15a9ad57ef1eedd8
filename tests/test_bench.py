"""`diffgemma bench` on CPU at a tiny shape: the JSON it writes and its options."""

from __future__ import annotations

import json
import subprocess
import sys

from diffgemma.bench import CONTEXTS, TINY_CONTEXTS, BenchOptions, run


def test_bench_tiny_writes_its_results(tmp_path):
    out = tmp_path / "bench.json"
    opts = BenchOptions(tiny=True, device="cpu", dtype="float32", contexts="64", gen_steps=2, out=str(out))
    run(opts)
    data = json.loads(out.read_text())
    ours = data["diffgemma"]
    assert (
        ours["denoise_step_ms"]["64"] > 0 and ours["prefill_tok_s"]["64"] > 0 and ours["generate_block_s"] > 0
    )
    assert data["threads"] == 1 and ours["fast_kernels"] is False  # the reference kernels on the CPU


def test_bench_defaults_and_usage_errors():
    assert BenchOptions(tiny=True).context_list() == [int(x) for x in TINY_CONTEXTS.split(",")]
    assert BenchOptions().context_list() == [int(x) for x in CONTEXTS.split(",")]
    for flag in ("--reps", "--gen-reps"):
        proc = subprocess.run(
            [sys.executable, "-m", "diffgemma.cli", "bench", "--tiny", flag, "3"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert (
            f"diffgemma: error: {flag} must be at least 10, got 3 (see `diffgemma bench --help`)"
            in proc.stderr
        )
