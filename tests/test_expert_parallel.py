"""Expert parallel (`runner.parallel`, `RuntimeConfig.expert_parallel`) on CPU with gloo: 2 and 4 processes, each
keeping a share of every layer's experts, give the tokens of one process and its logits bit for bit (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffgemma.config import RuntimeConfig, SamplerConfig
from diffgemma.engine.generate import Turn, drive
from diffgemma.runner.parallel import expert_range
from diffgemma.runner.runner import ModelRunner
from diffgemma.weights.loader import load_model

PROMPT = [5, 17, 99, 3, 250, 41, 7, 600, 12, 8, 300, 77]


def _run(path: Path, world: int) -> dict:
    """One generation and one denoise step's logits on this process's runner (expert parallel when world > 1)."""
    torch.set_num_threads(1)
    model = load_model(path, "cpu", torch.float32)
    runner = ModelRunner(model, RuntimeConfig(kernels="reference", expert_parallel=world))
    kv = runner.new_cache(256)
    sampler = SamplerConfig(max_new_tokens=2 * model.cfg.canvas_length).validated()
    out = drive(Turn(runner, PROMPT, kv, sampler, seed=3, max_new_tokens=2 * model.cfg.canvas_length))
    canvas = torch.arange(model.cfg.canvas_length)[None] % model.cfg.vocab_size
    logits = runner.denoise(canvas, kv)
    if world > 1:  # a second runner on the sharded model keeps its share (and the same logits)
        again = ModelRunner(model, RuntimeConfig(kernels="reference", expert_parallel=world))
        assert torch.equal(again.denoise(canvas, kv), logits)
    experts = tuple(model.layers[0].experts_gate_up.shape[:1])
    return {"tokens": out.token_ids, "logits": logits.flatten().tolist(), "experts": experts}


def _worker(rank: int, world: int, path: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        Path(out, f"{rank}.json").write_text(json.dumps(_run(Path(path), world)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gives_the_tokens_and_logits_of_one_process(tiny_a, tmp_path, world):
    alone = _run(tiny_a, 1)
    mp.spawn(_worker, args=(world, str(tiny_a), str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["experts"] == [alone["experts"][0] // world]  # this rank's share of the experts, no more
        assert got["tokens"] == alone["tokens"] and len(got["tokens"]) > 0
        assert got["logits"] == alone["logits"]  # bit for bit: each pair's owner's value plus zeros


def test_expert_parallel_refusals(tiny_a):
    assert expert_range(8, 1, 4) == (2, 4)
    with pytest.raises(ValueError, match="multiple of 3 experts"):
        expert_range(8, 0, 3)
    model = load_model(tiny_a, "cpu", torch.float32)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):  # no process group
        ModelRunner(model, RuntimeConfig(kernels="reference", expert_parallel=2))
    with pytest.raises(Exception, match="expert_parallel must be at least 1"):
        RuntimeConfig(expert_parallel=0).validated()


def test_serve_refuses_expert_parallel_in_one_line():
    import os
    import subprocess
    import sys

    env = {**os.environ, "DIFFGEMMA_EXPERT_PARALLEL": "2"}
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0 and "serve does not run expert parallel yet" in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [proc.stderr.splitlines()[-1]]
