"""Shared fixtures: tiny checkpoints in the real on-disk format, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffgemma.testing import write_tiny_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# Config A: prompt longer than the sliding window (8), two full layers, the real checkpoint's key spelling.
TINY_A: dict = {}
# Config B: transformers' per_layer_config spelling, three full layers, window 4, a wider canvas.
TINY_B: dict = dict(
    config_style="transformers",
    sliding_window=4,
    canvas_length=24,
    num_hidden_layers=5,
    layer_types=[
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    num_experts=6,
    top_k_experts=3,
)


@pytest.fixture(scope="session")
def tiny_a(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_a"), seed=1, **TINY_A)


@pytest.fixture(scope="session")
def tiny_b(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_b"), seed=2, **TINY_B)


@pytest.fixture(params=["tiny_a", "tiny_b"])
def tiny(request) -> Path:
    return request.getfixturevalue(request.param)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b: the norm of their difference over b's, in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


# The files whose tests take the most CPU (seconds on the 2-core machine, 2026-12-05), run first: pyproject's
# `--dist worksteal` hands each worker half the collection and lets an idle one take the other's unstarted tail, so
# with the long tests first both workers finish on short ones instead of one waiting on the other's last long test.
# Each file's tests stay together and in order (their module fixtures are built once a worker).
SLOW_FIRST = (
    "test_triton_moe_quant_interpret.py",  # 45: the quantized MoE kernels under Triton's interpreter
    "test_train_forward.py",  # 43: a torch.compile'd layer, forward and backward
    "test_fast_kernels.py",  # 40: the prefill regions compiled
    "test_bench.py",  # 74: bench runs, two under torchrun
    "test_expert_parallel.py",  # 41: torchrun over 2 and 4 processes
    "test_triton_interpret.py",  # 38
    "test_cli.py",  # 44: subprocesses
    "test_scheduler.py",  # 28
    "test_readme.py",  # 23
    "server/test_concurrent_conversations.py",  # 23: 32 clients x 3 turns, twice
    "test_quant.py",  # 20
    "session/test_golden.py",  # 19
    "chat/test_control_token_splits.py",  # 18
    "server/test_security.py",  # 16
    "test_train_run.py",  # 12
    "session/test_oplog.py",  # 12
    "server/test_data_parallel.py",  # 10
    "test_triton_topk_interpret.py",  # 9
)


def pytest_collection_modifyitems(session, config, items) -> None:
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item) -> int:
        path = Path(str(item.fspath)).resolve()
        rel = path.relative_to(tests).as_posix() if path.is_relative_to(tests) else ""
        return rank.get(rel, len(SLOW_FIRST))

    items.sort(key=key)  # stable: the other files, and each file's tests, keep their collection order
