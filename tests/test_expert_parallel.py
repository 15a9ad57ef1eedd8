"""Expert parallel (`runner.parallel`, `RuntimeConfig.expert_parallel`) on CPU with gloo: 2 and 4 processes, each
keeping a share of every layer's experts, the first running the engine and the others following, give the tokens
of one process and its logits bit for bit (fp32), an fp8 pack's as well; `serve --expert-parallel 2` answers as one
process does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffgemma.config import RuntimeConfig, SamplerConfig
from diffgemma.engine.generate import Turn, drive
from diffgemma.quant.weight import QuantWeight
from diffgemma.runner.parallel import expert_range, release
from diffgemma.runner.runner import ModelRunner
from diffgemma.weights import pack
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
        if rank == 0:
            result = _run(Path(path), world)
            release()
        else:  # this rank's experts for every forward of rank 0's, until it releases the group
            torch.set_num_threads(1)
            model = load_model(Path(path), "cpu", torch.float32)
            runner = ModelRunner(model, RuntimeConfig(kernels="reference", expert_parallel=world))
            with pytest.raises(RuntimeError, match="serves its experts to rank 0"):
                runner.denoise(
                    torch.zeros(1, model.cfg.canvas_length, dtype=torch.long), runner.new_cache(64)
                )
            runner.follow()
            result = {"experts": tuple(model.layers[0].experts_gate_up.shape[:1])}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _matches_one_process(path: Path, world: int, tmp_path: Path) -> None:
    """`world` gloo processes on the checkpoint at `path` against one: tokens and logits bit for bit."""
    alone = _run(path, 1)
    mp.spawn(_worker, args=(world, str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["experts"] == [alone["experts"][0] // world]  # this rank's share of the experts, no more
    lead = json.loads((tmp_path / "0.json").read_text())
    assert lead["tokens"] == alone["tokens"] and len(lead["tokens"]) > 0
    assert lead["logits"] == alone["logits"]  # bit for bit: each pair's owner's value plus zeros


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gives_the_tokens_and_logits_of_one_process(tiny_a, tmp_path, world):
    _matches_one_process(tiny_a, world, tmp_path)


def test_a_quantized_pack_under_expert_parallel_gives_the_tokens_of_one_process(tiny_a, tmp_path):
    packed = pack.quantize(tiny_a, tmp_path / "pack", "fp8", quiet=True)  # int4 needs wider experts
    assert isinstance(load_model(packed, "cpu", torch.float32).layers[0].experts_down, QuantWeight)
    _matches_one_process(packed, 2, tmp_path)  # each rank keeps half of every stored tensor: data and scales


def test_expert_parallel_refusals(tiny_a):
    assert expert_range(8, 1, 4) == (2, 4)
    with pytest.raises(ValueError, match="multiple of 3 experts"):
        expert_range(8, 0, 3)
    model = load_model(tiny_a, "cpu", torch.float32)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):  # no process group
        ModelRunner(model, RuntimeConfig(kernels="reference", expert_parallel=2))
    with pytest.raises(Exception, match="expert_parallel must be at least 1"):
        RuntimeConfig(expert_parallel=0).validated()


def test_serve_over_two_expert_parallel_processes_answers_as_one(tiny_a):
    """`serve --expert-parallel 2` under torchrun (gloo): the first process serves, the second runs its half of the
    experts; a greedy completion equals a one-process server's."""
    import subprocess
    import sys

    import httpx

    from tests.live_server import free_port, stop, wait_up

    body = {"prompt": "What is 7 + 5?", "max_tokens": 24, "seed": 3, "temperature": 0}
    texts = []
    for launch in (["-m", "torch.distributed.run", "--nproc-per-node", "2"], []):
        port = free_port()
        cmd = [sys.executable, *launch, "-m", "diffgemma.cli", "serve", "-m", str(tiny_a), "--port", str(port),
               "--device", "cpu", "--dtype", "float32"] + (["--expert-parallel", "2"] if launch else [])  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_up(proc, base)
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            reply = httpx.post(base + "/v1/completions", json={**body, "model": model}, timeout=60).json()
            texts.append(reply["choices"][0]["text"])
        finally:
            stop(proc)
    assert texts[0] == texts[1] and texts[0]


def test_serve_expert_parallel_outside_torchrun_is_one_line():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "serve", "--port", "0", "--expert-parallel", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "torchrun --nproc-per-node 2" in proc.stderr.splitlines()[-1]
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [proc.stderr.splitlines()[-1]]
