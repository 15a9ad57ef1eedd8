"""`diffgemma train` and `eval`: the demo model trained and its held-out accuracy."""

from __future__ import annotations

from pathlib import Path

import typer

from diffgemma.cli.options import DEVICE, DTYPE, _usage, one_line_errors


def train(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Checkpoint directory to write (and resume from)."),
    steps: int = typer.Option(3000, "--steps"),
    batch: int = typer.Option(128, "--batch"),
    lr: float = typer.Option(1.5e-3, "--lr"),
    warmup: int = typer.Option(150, "--warmup"),
    weight_decay: float = typer.Option(0.05, "--weight-decay"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/train_state."),
    init: str = typer.Option(
        "", "--init", help="Fine-tune from this checkpoint directory (weights + tokenizer)."
    ),
    mix: str = typer.Option("", "--mix", help='Task weights over the default mix, e.g. "arith=0.3,long=0".'),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1 ..."),
    seed: int = typer.Option(0, "--seed"),
    preset: str = typer.Option("demo", "--preset", help="Model shape: demo or tiny."),
    canvas_length: int = typer.Option(32, "--canvas-length"),
    max_denoising_steps: int = typer.Option(16, "--max-denoising-steps"),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="The tokenizer's size cap."),
    sc_prob: float = typer.Option(0.5, "--sc-prob"),
    pad_weight: float = typer.Option(0.25, "--pad-weight"),
    curriculum_steps: int = typer.Option(
        0,
        "--curriculum-steps",
        help="Cap retrieval lists at 2 + step // 400 lines before this step (0 = off).",
    ),
    lookup_weight: float = typer.Option(
        0.0,
        "--lookup-weight",
        help="Weight of the two-hop lookup attention loss: retrieval answers, schema choices (0 = off).",
    ),
    time_limit: float = typer.Option(0.0, "--time-limit", help="Stop cleanly after this many seconds."),
    log_every: int = typer.Option(25, "--log-every"),
    ckpt_every: int = typer.Option(500, "--ckpt-every"),
    max_shard_mb: float = typer.Option(
        0.0, "--max-shard-mb", help="Shard model.safetensors above this size."
    ),
    eval_n: int = typer.Option(0, "--eval-n", help="After training, evaluate N held-out prompts per task."),
) -> None:
    """Train a DiffusionGemma-architecture model on the demo corpus."""
    from diffgemma.train.batches import task_weights
    from diffgemma.train.cli import run_eval, run_train
    from diffgemma.train.trainer import PRESETS, TrainConfig

    if preset not in PRESETS:
        _usage(ctx, f"--preset must be one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    if lookup_weight < 0:
        _usage(ctx, f"--lookup-weight must be >= 0, got {lookup_weight}")
    if curriculum_steps < 0:
        _usage(ctx, f"--curriculum-steps must be >= 0, got {curriculum_steps}")
    try:
        task_weights(mix)
    except ValueError as e:
        _usage(ctx, str(e))
    cfg = TrainConfig(
        out=str(out),
        steps=steps,
        batch=batch,
        lr=lr,
        warmup=warmup,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
        preset=preset,
        canvas_length=canvas_length,
        max_denoising_steps=max_denoising_steps,
        vocab_size=vocab_size,
        sc_prob=sc_prob,
        pad_weight=pad_weight,
        time_limit=time_limit,
        log_every=log_every,
        ckpt_every=ckpt_every,
        max_shard_mb=max_shard_mb,
        resume=resume,
        init=init,
        mix=mix,
        curriculum_steps=curriculum_steps,
        lookup_weight=lookup_weight,
    )
    with one_line_errors():
        run_train(cfg)
        if eval_n > 0:
            run_eval(out, eval_n, device=None if device == "auto" else device, json_out=out / "eval.json")


def eval_(
    ctx: typer.Context,
    model: Path = typer.Option(..., "-m", "--model", help="Checkpoint directory."),
    n: int = typer.Option(50, "--n", help="Held-out prompts per task."),
    seed: int = typer.Option(1234, "--seed"),
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks (default: all of them)."),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens"),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON to this file."),
) -> None:
    """Held-out accuracy of a model on the demo tasks."""
    from diffgemma.train import data
    from diffgemma.train.cli import run_eval

    chosen = tuple(t for t in (tasks or ",".join(data.TASKS)).split(",") if t)
    unknown = [t for t in chosen if t not in data.TASKS]
    if unknown:
        _usage(ctx, f"unknown tasks {unknown}; choose from {', '.join(data.TASKS)}")
    with one_line_errors():
        run_eval(model, n, seed, device, dtype, chosen, max_new_tokens, json_out)
