"""`diffgemma bench`: prefill and denoise speed, a fixed-step generation and peak memory of our runner, on random
weights at the real 26B-A4B shape generated directly on the device (never read from disk) or on a checkpoint.

Timings use CUDA events after warm-up; each number is a median. `bench/compare_hf.py` measures transformers on the
very same weights beside it and checks the two sets of logits.

The modules, by measurement: speed.py (prefill, denoise, generation), batching.py (requests at once),
scoring.py (a question schema), accuracy.py (quantized and top-k errors); beside them shapes.py, weights.py,
timing.py, options.py, prepare.py (the run set up) and report.py (the table and the JSON).
"""

from __future__ import annotations

from typing import Any

import torch

from diffgemma.bench.accuracy import denoise_layers, layer_outputs, quant_error, topk_error
from diffgemma.bench.batching import CONCURRENT_BLOCKS, concurrency
from diffgemma.bench.options import BenchOptions
from diffgemma.bench.prepare import (
    bench_device,
    check_cpu_memory,
    choose_weights,
    cpu_available_bytes,
    join_ranks,
    ours_need,
    random_model_bytes,
    setup,
)
from diffgemma.bench.report import log, provenance, save, source_commit, table, write_json
from diffgemma.bench.scoring import demo_schema, schema_timing
from diffgemma.bench.shapes import CONTEXTS, GIB, REAL_CONFIG, TINY_CONTEXTS, tiny_config
from diffgemma.bench.speed import generate_rate, measure
from diffgemma.bench.timing import OursRunner, fixed_steps_sampler, timed
from diffgemma.bench.weights import kv_bytes, load_checkpoint, quantize_weights, random_model, weight_bytes
from diffgemma.runner.parallel import leave, release

__all__ = [
    "BenchOptions",
    "CONCURRENT_BLOCKS",
    "CONTEXTS",
    "GIB",
    "OursRunner",
    "REAL_CONFIG",
    "TINY_CONTEXTS",
    "bench_device",
    "check_cpu_memory",
    "choose_weights",
    "concurrency",
    "cpu_available_bytes",
    "demo_schema",
    "denoise_layers",
    "fixed_steps_sampler",
    "generate_rate",
    "join_ranks",
    "kv_bytes",
    "layer_outputs",
    "load_checkpoint",
    "log",
    "measure",
    "ours_need",
    "provenance",
    "quant_error",
    "quantize_weights",
    "random_model",
    "random_model_bytes",
    "run",
    "save",
    "schema_timing",
    "setup",
    "source_commit",
    "table",
    "timed",
    "tiny_config",
    "topk_error",
    "weight_bytes",
    "write_json",
]


def run(opts: BenchOptions) -> dict[str, Any]:
    """`diffgemma bench`: measure our runner, print the table, write the JSON; returns the results. Under
    torchrun with --data-parallel every rank measures and the first one reports; with --expert-parallel the first
    one measures while the others run their experts' share of its forwards."""
    opts.check()
    opts = choose_weights(opts, bench_device(opts))
    ranks = join_ranks(opts)
    runner, _, results = setup(opts)
    results.update(expert_parallel=opts.expert_parallel, data_parallel=opts.data_parallel, ranks=ranks)
    if opts.expert_parallel > 1 and torch.distributed.get_rank() > 0:
        runner.follow()  # rank 0 measures; this rank runs its experts' share of every forward
        leave()
        return results
    results["diffgemma"] = measure(
        OursRunner(runner), opts.context_list(), opts, runner.device, ours_need(runner), log
    )
    results["diffgemma"]["weights_gib"] = results["weight_gib"]
    if opts.concurrency:
        ns = [int(x) for x in opts.concurrency.split(",") if x.strip()]
        results["concurrency"] = concurrency(runner, opts, ns, torch.Generator().manual_seed(7))
    if opts.schema:
        results["schema"] = schema_timing(runner, opts.reps)
    if opts.topk_error:
        results["topk_error"] = topk_error(runner, opts.context_list(), torch.Generator().manual_seed(11))
    if opts.expert_parallel > 1:
        release()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
        leave()
        return results
    save(results, opts.out, runner.device)
    print(table(results, opts.context_list()))
    leave()
    return results
