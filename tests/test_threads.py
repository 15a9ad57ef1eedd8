"""CPU threads: one for a small model (its ops are too small for threads, which a busy machine makes far slower),
torch's default for a large one, and `threads` overrides either; idle OpenMP threads sleep (PASSIVE), so that
concurrent processes do not spin on each other's cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import diffgemma
from diffgemma.bench import REAL_CONFIG
from diffgemma.config import ModelConfig
from diffgemma.runner.devices import SMALL_MODEL_ACTIVE_PARAMS, TORCH_THREADS, active_params, set_cpu_threads
from diffgemma.weights.download import bundled_model


def test_the_thread_count_follows_the_models_size(tiny_a) -> None:
    before = torch.get_num_threads()
    try:
        real = ModelConfig.from_dict(REAL_CONFIG)
        demo = ModelConfig.from_dir(bundled_model())
        assert 3.7e9 < active_params(real) < 3.9e9  # the 26B-A4B model: 3.8B active parameters a token
        assert active_params(demo) < SMALL_MODEL_ACTIVE_PARAMS < active_params(real)
        assert set_cpu_threads(demo) == 1 == torch.get_num_threads()
        assert set_cpu_threads(real) == TORCH_THREADS == torch.get_num_threads()
        assert set_cpu_threads(demo, 2) == 2 == torch.get_num_threads()
        diffgemma.load(tiny_a, "cpu")
        assert torch.get_num_threads() == 1
        diffgemma.load(tiny_a, "cpu", threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def openmp_spin(code: str, **env: str) -> tuple[str, int]:
    """What a fresh interpreter running `code` prints, and how many times its OpenMP threads poll before they sleep
    (libgomp's own report, OMP_DISPLAY_ENV=VERBOSE, of what it read as torch loaded it: 0 under PASSIVE, 300,000
    when nothing is set; its OMP_WAIT_POLICY line reads PASSIVE in both cases)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    if found is None:
        pytest.skip("this torch's OpenMP runtime is not libgomp, or does not report its environment")
    return proc.stdout.strip(), int(found.group(1))


def test_the_cli_and_import_diffgemma_start_torchs_openmp_with_sleeping_threads(tiny_a) -> None:
    show = "from diffgemma.runner.devices import OMP_WAIT_POLICY; print(OMP_WAIT_POLICY)"
    assert openmp_spin(f"import diffgemma, torch; {show}") == ("PASSIVE", 0)
    # the command line: `python -m diffgemma.cli` imports the package, which sets it, before a command that loads a
    # model imports torch (its help and argument errors import none)
    ask = ["diffgemma", "ask", "-m", str(tiny_a), "-p", "hi", "--max-tokens", "1"]
    cli = f"import runpy, sys; sys.argv = {ask!r}; runpy.run_module('diffgemma.cli', run_name='__main__')"
    assert openmp_spin(cli)[1] == 0
    # a user's own policy is kept
    out, spin = openmp_spin(f"import diffgemma; {show}", OMP_WAIT_POLICY="ACTIVE")
    assert out == "ACTIVE" and spin > 300_000
    # torch imported first has started OpenMP already: nothing set that would not be used, and reported so
    assert openmp_spin(f"import torch, diffgemma; {show}") == ("None", 300_000)
