"""`diffgemma bench` on CPU at a tiny shape: the JSON it writes and its options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diffgemma.bench import CONTEXTS, TINY_CONTEXTS, BenchOptions, run
from diffgemma.weights.download import bundled_model


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
    said = data["provenance"]  # what it measured: the code, the software, the device
    assert list(data)[0] == "provenance" and said["device_type"] == "cpu"
    assert set(said) >= {"commit", "dirty", "diffgemma", "torch", "triton", "cuda", "device"}


def test_provenance_names_the_commit_and_the_software(tmp_path, monkeypatch):
    import torch

    from diffgemma.bench import report

    said = report.provenance(torch.device("cpu"))
    assert said["torch"] == torch.__version__ and said["cuda"] == torch.version.cuda
    head = subprocess.run(
        ["git", "-C", str(report.PACKAGE), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # a checkout: its commit, and whether tracked files differ from it
        assert said["commit"] == head.stdout.strip() and isinstance(said["dirty"], bool)
    # an installed copy (no checkout holds it as its src/diffgemma): no commit, rather than a wrong one
    monkeypatch.setattr(report, "PACKAGE", tmp_path / "site-packages" / "diffgemma")
    assert report.source_commit() == (None, None)
    path = report.write_json(tmp_path / "a" / "r.json", {"x": 1}, torch.device("cpu"), indent=1)
    doc = json.loads(path.read_text())
    assert doc["x"] == 1 and doc["provenance"]["commit"] is None and doc["provenance"]["device"]


def test_bench_concurrency_runs_n_requests_together(tmp_path):
    out = tmp_path / "bench.json"
    opts = BenchOptions(
        tiny=True, device="cpu", dtype="float32", contexts="64", gen_steps=0, fixed_steps=2, gen_prompt=40,
        concurrency="1,3", out=str(out),
    )  # fmt: skip
    run(opts)
    conc = json.loads(out.read_text())["concurrency"]
    assert set(conc) == {"1", "3"} and all(conc[n]["tok_s"] > 0 and conc[n]["step_ms"] > 0 for n in conc)
    assert [conc[n]["canvases_per_forward"] for n in ("1", "3")] == [1, 3]  # the three share each forward


def test_bench_schema_times_a_first_request_and_a_repeat(tmp_path):
    out = tmp_path / "bench.json"
    opts = BenchOptions(
        model=str(bundled_model()), device="cpu", dtype="float32", contexts="64", gen_steps=0, fixed_steps=0,
        schema=True, out=str(out),
    )  # fmt: skip
    run(opts)
    timing = json.loads(out.read_text())["schema"]
    first, repeat = timing["first"], timing["repeat"]
    assert first["reused_tokens"] == 0 < repeat["reused_tokens"]  # the repeat prefills only its state
    # medians of each field: each positive (a median of sums need not be the sum of the medians)
    assert all(
        min(r["wall_ms"], r["prefill_ms"], r["denoise_ms"]) > 0 and r["reads"] >= 1 for r in (first, repeat)
    )
    with pytest.raises(ValueError, match="holds the demo tokenizer"):  # the tiny shape's 1,024 ids
        run(BenchOptions(tiny=True, device="cpu", dtype="float32", contexts="64", gen_steps=0, schema=True))


def test_bench_topk_error_measures_sparse_against_dense_attention(tmp_path):
    out = tmp_path / "bench.json"
    opts = BenchOptions(
        tiny=True, device="cpu", dtype="float32", contexts="40,256", gen_steps=0, fixed_steps=0, topk_error=True,
        out=str(out),
    )  # fmt: skip
    run(opts)
    err = json.loads(out.read_text())["topk_error"]
    # 40 + a 32-row canvas = 72 keys: k = 64 of them, so sparse; at 256, 64 of 288
    assert err["40"]["keep"] == err["256"]["keep"] == 64
    for row in err.values():
        sparse, floor = row["topk_vs_dense"], row["fast_vs_reference"]
        assert sparse["logits_rel_err"] > 0 and 0 < sparse["argmax_agreement"] <= 1
        assert len(sparse["layer_rel_err"]) == 5  # the tiny shape's five layers
        assert (
            sparse["layer_rel_err"][0] == 0 < sparse["layer_rel_err"][1]
        )  # sliding, then the first full layer
        assert floor["logits_rel_err"] == 0 and floor["argmax_agreement"] == 1  # CPU: one kernel table


def test_bench_quant_quantizes_on_the_device_and_measures_the_error(tmp_path):
    out = tmp_path / "bench.json"
    opts = BenchOptions(
        tiny=True, device="cpu", dtype="float32", contexts="64", gen_steps=0, quant="int4", out=str(out)
    )
    opts.quant_set = ("attn=fp8",)
    run(opts)
    data = json.loads(out.read_text())
    q = data["quant"]
    assert q["profile"] == "int4" and q["formats"]["attn"] == "fp8" and q["overrides"] == {"attn": "fp8"}
    layers = len(q["layer_rel_err"])
    assert (
        layers == 5
        and 0 < q["layer_rel_err"][0] < q["logits_rel_err"] < 2
        and 0 <= q["argmax_agreement"] <= 1
    )
    assert q["bf16_repeat"]["logits_rel_err"] == 0.0  # the reference kernels are deterministic
    ours = data["diffgemma"]
    assert ours["weights_gib"] < data["bf16_weight_gib"] and ours["generate_tok_s"] > 0
    assert ours["generate_tok_s"] > ours["generate_tok_s_with_prefill"]


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
    for args, message in (
        (["--concurrency", "2,x"], "--concurrency takes positive counts"),
        (["--quant", "q4"], "unknown profile 'q4'"),
        (["--set", "attn=fp8"], "needs --quant"),
        (["--expert-parallel", "2", "--data-parallel", "2"], "not both above 1"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "diffgemma.cli", "bench", "--tiny", *args], capture_output=True, text=True
        )
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("flag", ["--expert-parallel", "--data-parallel"])
def test_bench_over_two_processes_under_torchrun(tmp_path, flag):
    """Two CPU processes over gloo, launched as on GPUs: the first rank writes the results of both."""
    out = tmp_path / "bench.json"
    args = ["--tiny", "--contexts", "64", "--gen-steps", "0", "--fixed-steps", "2", "--gen-prompt", "40"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "diffgemma.cli", "bench",
         *args, "--concurrency", "1,2", flag, "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["diffgemma"]["denoise_step_ms"]["64"] > 0
    conc = data["concurrency"]["2"]
    if flag == "--data-parallel":  # each rank's own two requests, summed
        assert conc["tok_s_all_ranks"] > conc["tok_s"] > 0
    else:
        assert "tok_s_all_ranks" not in conc and conc["canvases_per_forward"] == 2
    alone = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", *args, flag, "2"], capture_output=True, text=True
    )
    assert alone.returncode != 0 and "torchrun --nproc-per-node 2" in alone.stderr
    assert alone.stderr.count("\n") == 1


def _compare_hf():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "compare_hf.py"
    spec = importlib.util.spec_from_file_location("compare_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_hf_tiny_measures_both_engines_and_checks_the_logits(tmp_path):
    out = tmp_path / "compare.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "64", "--gen-steps", "2"]
    assert _compare_hf().main([*argv, "--check-context", "48", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for engine in ("diffgemma", "transformers"):
        assert data[engine]["denoise_step_ms"]["64"] > 0 and data[engine]["generate_block_s"] > 0
    check = data["check_hf"]
    assert data["transformers_setup"]["shared_parameters"] > 0
    # fp32 on the same weights: the two implementations agree to rounding, end to end and layer by layer
    for part in ("end_to_end", "on_hf_cache"):
        for sc in ("no_sc", "sc"):
            assert check[part][sc]["max_abs_diff"] < 1e-4 * max(1.0, check[part][sc]["logit_std"])
            assert check[part][sc]["argmax_agreement"] == 1.0
    assert check["per_layer"]["reference"]["worst_rel_mean"] < 1e-5
    assert check["per_layer"]["decoder_input"]["max_abs_diff"] < 1e-5


def test_compare_hf_without_transformers_is_one_line_and_exit_2():
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "compare_hf.py"
    script = (
        "import sys, runpy; sys.modules['transformers'] = None; sys.argv = ['compare_hf.py', '--tiny'];"
        f"runpy.run_path({str(path)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "compare_hf: error: transformers is not installed" in proc.stderr


SHORT = ["--contexts", "64", "--gen-steps", "2", "--fixed-steps", "2", "--gen-prompt", "40"]


def test_bare_bench_on_cpu_measures_the_demo_model_and_says_so(tmp_path):
    import torch

    out = tmp_path / "bench.json"
    cpu = ["--device", "cpu"] if torch.cuda.is_available() else []  # bare, as on a machine without a GPU
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", *cpu, *SHORT, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "bench on CPU" in line]
    assert len(said) == 1 and "measuring the bundled demo model" in said[0] and "--real" in said[0]
    assert "| denoise step ms | 64 |" in proc.stdout  # the results table
    data = json.loads(out.read_text())
    assert data["weights"] == f"checkpoint {bundled_model()}" and data["dtype"] == "float32"
    assert data["diffgemma"]["denoise_step_ms"]["64"] > 0 and data["threads"] == 1
    # PASSIVE, set by importing diffgemma (a user's own value kept)
    assert data["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert data["provenance"]["device_type"] == "cpu"


def test_the_real_shape_on_cpu_is_refused_before_allocating_when_it_cannot_fit(monkeypatch):
    import torch

    import diffgemma.bench.prepare as B

    weights, cache = B.random_model_bytes(B.REAL_CONFIG, torch.bfloat16, 1024)
    assert 47 < weights / B.GIB < 50  # 25.8B parameters in two bytes each
    monkeypatch.setattr(B, "cpu_available_bytes", lambda: 8 * B.GIB)
    monkeypatch.setattr(B, "random_model", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(ValueError) as refused:
        run(BenchOptions(real=True, device="cpu", dtype="bfloat16", contexts="1024"))
    need = (weights + cache + B.GIB) / B.GIB
    assert str(refused.value).startswith(
        f"the real 26B-A4B shape needs ~{need:.1f} GiB in bfloat16 ({weights / B.GIB:.1f} of weights"
    )
    assert "this machine has 8.0 GiB available" in str(refused.value)
    monkeypatch.undo()
    monkeypatch.setattr(B, "cpu_available_bytes", lambda: 8 * B.GIB)
    run(BenchOptions(tiny=True, device="cpu", contexts="64", gen_steps=0, fixed_steps=0))  # the tiny one fits


def test_the_real_shape_refusal_is_one_line_through_the_cli():
    import torch

    import diffgemma.bench.prepare as B

    weights, cache = B.random_model_bytes(B.REAL_CONFIG, torch.float32, 1024)
    available = B.cpu_available_bytes()
    if available is None or available > weights + cache + B.GIB:
        pytest.skip("this machine holds the real shape in float32")
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", "--real", "--device", "cpu", "--contexts", "1024"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        lines[0].startswith("diffgemma: error: the real 26B-A4B shape needs ~")
        and "GiB available" in lines[0]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "bench", "--real", "--tiny"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "pass one of them" in proc.stderr


def test_concurrency_memory_plan_fits_32_at_1k_and_16_at_32k_on_an_h200():
    """`concurrency_bytes` at the real shape (bf16): a cache a request and the batched pass's three [N * C, V]
    buffers; with the weights (47.0 GiB) and 20 GiB of headroom for activations and graph pools, 32 requests at
    1k and 16 at 32k fit one H200's 141 GB, and 64 at 32k do not (the plan can say no)."""
    import torch

    from diffgemma.bench.batching import concurrency_bytes
    from diffgemma.bench.shapes import GIB, REAL_CONFIG
    from diffgemma.config import ModelConfig

    cfg = ModelConfig.from_dict(REAL_CONFIG)
    weights, headroom, h200 = 47.0 * GIB, 20 * GIB, 141e9

    def plan(n: int, prompt: int) -> float:
        return weights + headroom + concurrency_bytes(cfg, n, prompt, torch.bfloat16)

    assert plan(32, 1024) < h200 and plan(16, 32768) < h200
    assert plan(64, 32768) > h200
    # the caches dominate: 32 at 1k hold 23.4 GiB of K/V, the buffers 3 x 4 GiB
    assert 35 * GIB < concurrency_bytes(cfg, 32, 1024, torch.bfloat16) < 36 * GIB
