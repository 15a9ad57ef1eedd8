"""`diffgemma bench`: its options, handed to diffgemma.bench."""

from __future__ import annotations

from pathlib import Path

import typer

from diffgemma.cli.options import _usage, one_line_errors


def bench(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "-m", "--model", help="Checkpoint directory (default: random weights)."
    ),
    tiny: bool = typer.Option(False, "--tiny", help="Random weights at a tiny shape (a CPU smoke test)."),
    real: bool = typer.Option(
        False, "--real", help="Random weights at the real 26B-A4B shape on CPU too (a GPU's default)."
    ),
    device: str | None = typer.Option(
        None, "--device", help="cuda or cpu (default: cuda when there is one; on CPU the demo model bare)."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: bfloat16 on a GPU, float32 on CPU)."
    ),
    contexts: str | None = typer.Option(
        None,
        "--contexts",
        help="Comma-separated context lengths (default 1024,8192,32768,131072; --tiny 256,1024).",
    ),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: 1 for a small model)."),
    reps: int = typer.Option(10, "--reps", help="Timed repetitions (median), at least 10."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls first."),
    prefill_chunk: int = typer.Option(8192, "--prefill-chunk", help="Tokens a fast prefill pass."),
    gen_steps: int = typer.Option(
        48, "--gen-steps", help="Fixed denoise steps of the generation (0 = skip)."
    ),
    gen_prompt: int = typer.Option(1024, "--gen-prompt", help="Prompt tokens of the generation."),
    gen_reps: int = typer.Option(10, "--gen-reps", help="Timed generations (median), at least 10."),
    fixed_steps: int = typer.Option(
        16, "--fixed-steps", help="Steps a block of the tok/s generation, early stops off (0 = skip)."
    ),
    quant: str | None = typer.Option(
        None, "--quant", help="Quantize the weights on the device first: a profile (int4, fp8, ...)."
    ),
    quant_set: list[str] = typer.Option(
        [], "--set", help="CLASS=FORMAT on top of --quant, as diffgemma quantize.", show_default=False
    ),
    init: str = typer.Option(
        "hf", "--init", help="Random weights: transformers' init (hf) or the wide test one."
    ),
    kernels: str = typer.Option("auto", "--kernels", help="auto, fast or reference."),
    compile: bool = typer.Option(
        True, "--compile/--no-compile", help="torch.compile the fast kernels' regions."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
    concurrency: str | None = typer.Option(
        None, "--concurrency", help="Also N requests at once through the scheduler, e.g. 1,2,4,8,16."
    ),
    schema: bool = typer.Option(
        False, "--schema", help="Also a 3-question schema scored: a first request and a repeat."
    ),
    topk_error: bool = typer.Option(
        False, "--topk-error", help="Also top-k sparse against dense attention at each context (errors)."
    ),
    expert_parallel: int = typer.Option(
        1,
        "--expert-parallel",
        help="Ranks sharing each layer's experts (run under torchrun --nproc-per-node N).",
    ),
    data_parallel: int = typer.Option(
        1,
        "--data-parallel",
        help="Ranks each running a replica, tok/s summed (under torchrun --nproc-per-node N).",
    ),
) -> None:
    """Measure prefill and denoise speed, a fixed-step generation and peak memory (`bench/compare_hf.py` runs
    transformers on the same weights beside it)."""
    from diffgemma.bench import BenchOptions, run

    opts = BenchOptions(
        model=model,
        tiny=tiny,
        real=real,
        device=device,
        dtype=dtype,
        contexts=contexts,
        threads=threads,
        reps=reps,
        warmup=warmup,
        prefill_chunk=prefill_chunk,
        gen_steps=gen_steps,
        gen_prompt=gen_prompt,
        gen_reps=gen_reps,
        fixed_steps=fixed_steps,
        quant=quant,
        quant_set=tuple(quant_set),
        init=init,
        kernels=kernels,
        compile=compile,
        out=str(out) if out else None,
        concurrency=concurrency,
        schema=schema,
        topk_error=topk_error,
        expert_parallel=expert_parallel,
        data_parallel=data_parallel,
    )
    try:
        opts.check()
    except ValueError as e:
        _usage(ctx, str(e))
    with one_line_errors():
        run(opts)
