"""The run prepared: ranks, the device, the weights chosen and checked to fit, the runner built."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffgemma.bench.accuracy import layer_outputs, quant_error
from diffgemma.bench.options import BenchOptions
from diffgemma.bench.report import log
from diffgemma.bench.shapes import GIB, REAL_CONFIG, TINY_CONTEXTS, tiny_config
from diffgemma.bench.weights import kv_bytes, load_checkpoint, quantize_weights, random_model, weight_bytes
from diffgemma.config import ModelConfig, load_runtime_config
from diffgemma.model.model import DiffusionGemma
from diffgemma.runner.devices import OMP_WAIT_POLICY, check_device, set_cpu_threads
from diffgemma.runner.parallel import join
from diffgemma.runner.runner import ModelRunner


def join_ranks(opts: BenchOptions) -> int:
    """The process group of an --expert-parallel / --data-parallel run (torchrun's); its size, or 1."""
    want = max(opts.expert_parallel, opts.data_parallel)
    if want == 1:
        return 1
    return join(want, "--expert-parallel" if opts.expert_parallel > 1 else "--data-parallel")[1]


def cpu_available_bytes() -> int | None:
    """Memory this machine can still give a process (MemAvailable on Linux), or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def random_model_bytes(cfg_dict: dict[str, Any], dtype: torch.dtype, ctx: int) -> tuple[int, int]:
    """Bytes `random_model` allocates for this shape's weights, and a cache of `ctx` tokens (counted on the meta
    device: nothing allocated)."""
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    es = torch.tensor([], dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * es, kv_bytes(cfg, ctx + 2 * cfg.canvas_length, dtype)


def check_cpu_memory(cfg_dict: dict[str, Any], dtype: torch.dtype, ctx: int, what: str) -> None:
    """ValueError, before anything is allocated, when random weights of this shape and the largest context's cache
    do not fit the memory this machine has available (the kernel would kill the process part-way instead)."""
    available = cpu_available_bytes()
    weights, cache = random_model_bytes(cfg_dict, dtype, ctx)
    need = weights + cache + GIB  # a GiB for activations and the process itself
    if available is not None and need > available:
        raise ValueError(
            f"{what} needs ~{need / GIB:.1f} GiB in {str(dtype).removeprefix('torch.')} ({weights / GIB:.1f} of "
            f"weights, {cache / GIB:.1f} of {ctx}-token cache) and this machine has {available / GIB:.1f} GiB "
            "available: measure the demo model (bare on CPU), --tiny, -m DIR, or on a GPU"
        )


def bench_device(opts: BenchOptions) -> torch.device:
    """--device (ValueError for one this torch cannot run on), else cuda when there is one, else cpu."""
    return (
        check_device(opts.device)
        if opts.device
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )


def choose_weights(opts: BenchOptions, device: torch.device) -> BenchOptions:
    """What a bare bench measures: the real shape on a GPU; on CPU, where the real shape's ~48 GiB of weights
    rarely fit (and would take hours), the bundled demo model (--tiny's shape in a build without it), said on
    stderr. -m, --tiny and --real are taken as given."""
    if device.type != "cpu" or opts.model or opts.tiny or opts.real:
        return opts
    from diffgemma.weights.download import bundled_model

    demo = bundled_model()
    contexts = opts.contexts or TINY_CONTEXTS  # the demo model has 8,192 positions
    if demo is None:
        log(
            "diffgemma: bench on CPU: measuring the tiny shape (--real for the 26B-A4B shape, -m DIR a checkpoint)"
        )
        return dataclasses.replace(opts, tiny=True, contexts=contexts)
    log(
        f"diffgemma: bench on CPU: measuring the bundled demo model ({demo.name}), not the 26B-A4B shape "
        "(--real for it, -m DIR for a checkpoint, --tiny for the tiny shape)"
    )
    return dataclasses.replace(opts, model=str(demo), contexts=contexts)


def setup(opts: BenchOptions) -> tuple[ModelRunner, dict[str, Any], dict[str, Any]]:
    """The model on its device, its runner, the config it was built from and the results' header (`opts` checked
    by the caller)."""
    device = bench_device(opts)
    dtype_name = opts.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "dtype": dtype_name,
        "contexts": opts.context_list(),
    }
    if not opts.model and device.type == "cpu":
        shape = "the tiny shape" if opts.tiny else "the real 26B-A4B shape"
        check_cpu_memory(tiny_config() if opts.tiny else REAL_CONFIG, dtype, max(opts.context_list()), shape)
    t0 = time.perf_counter()
    if opts.model:
        model, cfg_dict = load_checkpoint(opts.model, str(device), dtype)
        results["weights"] = f"checkpoint {opts.model}"
    else:
        cfg_dict = tiny_config() if opts.tiny else REAL_CONFIG
        model = random_model(cfg_dict, str(device), dtype, init=opts.init)
        results["weights"] = (
            "random, generated on device"
            + (" (tiny shape)" if opts.tiny else " (real shape)")
            + (", transformers' _init_weights distribution" if opts.init == "hf" else ", wide test init")
        )
        results["init"] = opts.init
    if device.type == "cpu":
        results["threads"] = set_cpu_threads(model.cfg, opts.threads)
        # PASSIVE unless the user set another or imported torch before diffgemma
        results["omp_wait_policy"] = OMP_WAIT_POLICY
    # DIFFGEMMA_* variables apply, as in every command (`DIFFGEMMA_ATTENTION_TOPK=1`: the sparse full layers)
    runtime = load_runtime_config(
        kernels=opts.kernels,
        compile=opts.compile,
        prefill_chunk=opts.prefill_chunk,
        expert_parallel=opts.expert_parallel,
    )
    results["attention_topk"] = runtime.attention_topk
    results["batch_invariant"] = runtime.batch_invariant  # DIFFGEMMA_BATCH_INVARIANT=1: solo_equal 1.0
    runner = ModelRunner(model, runtime)
    if opts.quant:  # the bf16 model's outputs first, then the same weights quantized
        g = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, model.cfg.vocab_size, (1, 512), generator=g).to(device)
        canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g).to(device)
        ref = layer_outputs(model, prompt, canvas)
        repeat = quant_error(
            ref, layer_outputs(model, prompt, canvas)
        )  # the noise floor: bf16 against itself
        results["bf16_weight_gib"] = weight_bytes(model) / GIB
        results["quant"] = quantize_weights(model, opts.quant, opts.quant_set)
        results["quant"].update(quant_error(ref, layer_outputs(model, prompt, canvas)))
        results["quant"]["bf16_repeat"] = repeat
        del ref
        log(
            f"quantized ({opts.quant}{''.join(' --set ' + s for s in opts.quant_set)}): logits relative error "
            f"{results['quant']['logits_rel_err']:.4f}, argmax agreement {results['quant']['argmax_agreement']:.3f}"
        )
    results["weight_gib"] = weight_bytes(model) / GIB
    log(f"model ready in {time.perf_counter() - t0:.1f} s: {results['weight_gib']:.2f} GiB of weights")
    return runner, cfg_dict, results


def ours_need(runner: ModelRunner) -> Callable[[int], int]:
    """Device bytes our measurement at a context needs: cache, prefill-chunk activations, graph pools, generously."""
    cfg, device = runner.cfg, runner.device
    return lambda ctx: (
        kv_bytes(cfg, ctx + 2 * cfg.canvas_length, runner.dtype) + 8 * GIB if device.type == "cuda" else 0
    )
