"""`diffgemma train` and `diffgemma eval` entry points (argparse; the typer CLI forwards argv here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diffgemma.argparser import ArgumentParser
from diffgemma.train import data


def train_main(argv: list[str] | None = None) -> dict:
    from diffgemma.train.trainer import PRESETS, TrainConfig, task_weights, train

    d = TrainConfig(out="")
    ap = ArgumentParser(prog="diffgemma train", description="Train a DiffusionGemma model on the demo corpus")
    ap.add_argument("--out", required=True, help="checkpoint directory to write (and resume from)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    ap.add_argument(
        "--init", default="", help="fine-tune from this checkpoint directory (weights + tokenizer)"
    )
    ap.add_argument(
        "--mix", default="", help='task weights over the default mix, e.g. "arith=0.3,retrieval_short=0.2"'
    )
    ap.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1 ...")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=d.preset)
    ap.add_argument("--canvas-length", type=int, default=d.canvas_length)
    ap.add_argument("--max-denoising-steps", type=int, default=d.max_denoising_steps)
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--sc-prob", type=float, default=d.sc_prob)
    ap.add_argument("--pad-weight", type=float, default=d.pad_weight)
    ap.add_argument(
        "--curriculum-steps",
        type=int,
        default=d.curriculum_steps,
        help="cap retrieval lists at 2 + step // 400 lines before this step (0 = off, the default)",
    )
    ap.add_argument(
        "--lookup-weight",
        type=float,
        default=d.lookup_weight,
        help="weight of the two-hop retrieval attention loss: layer 0 head 1 from each list code word to its key, "
        "the last full layer's head 0 from the answer's slot to the asked line's code word (0 = off)",
    )
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop cleanly after this many seconds")
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    ap.add_argument("--max-shard-mb", type=float, default=0.0)
    ap.add_argument(
        "--eval-n", type=int, default=0, help="after training, evaluate N held-out prompts per task"
    )
    a = ap.parse_args(argv)
    cfg = TrainConfig(
        out=a.out,
        steps=a.steps,
        batch=a.batch,
        lr=a.lr,
        warmup=a.warmup,
        weight_decay=a.weight_decay,
        seed=a.seed,
        device=a.device,
        preset=a.preset,
        canvas_length=a.canvas_length,
        max_denoising_steps=a.max_denoising_steps,
        vocab_size=a.vocab_size,
        sc_prob=a.sc_prob,
        pad_weight=a.pad_weight,
        time_limit=a.time_limit,
        log_every=a.log_every,
        ckpt_every=a.ckpt_every,
        max_shard_mb=a.max_shard_mb,
        resume=a.resume,
        init=a.init,
        mix=a.mix,
        curriculum_steps=a.curriculum_steps,
        lookup_weight=a.lookup_weight,
    )
    try:
        task_weights(cfg.mix)
    except ValueError as e:
        ap.error(str(e))
    if cfg.lookup_weight < 0:
        ap.error(f"--lookup-weight must be >= 0, got {cfg.lookup_weight}")
    if cfg.curriculum_steps < 0:
        ap.error(f"--curriculum-steps must be >= 0, got {cfg.curriculum_steps}")
    summary = train(cfg)
    print(json.dumps(summary, indent=2))
    if a.eval_n > 0:
        eval_main(
            [
                "-m",
                a.out,
                "--n",
                str(a.eval_n),
                "--device",
                cfg.device if cfg.device != "auto" else "",
                "--json",
                str(Path(a.out) / "eval.json"),
            ]
        )
    return summary


def eval_main(argv: list[str] | None = None) -> dict:
    from diffgemma.train.eval import evaluate, format_table, write_json

    ap = ArgumentParser(prog="diffgemma eval", description="Held-out accuracy of a model on the demo tasks")
    ap.add_argument("-m", "--model", required=True, help="checkpoint directory")
    ap.add_argument("--n", type=int, default=50, help="held-out prompts per task")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--tasks", default=",".join(data.TASKS))
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--json", default="", help="also write the result as JSON to this file")
    a = ap.parse_args(argv)
    tasks = tuple(t for t in a.tasks.split(",") if t)
    unknown = [t for t in tasks if t not in data.TASKS]
    if unknown:
        ap.error(f"unknown tasks {unknown}; choose from {', '.join(data.TASKS)}")
    result = evaluate(a.model, a.n, a.seed, a.device or None, a.dtype or None, tasks, a.max_new_tokens)
    print(format_table(result))
    if a.json:
        write_json(result, a.json)
        print(f"wrote {a.json}")
    return result


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "eval"):
        print("usage: python -m diffgemma.train.cli {train,eval} ...", file=sys.stderr)
        raise SystemExit(2)
    (train_main if argv[0] == "train" else eval_main)(argv[1:])


if __name__ == "__main__":
    main()
