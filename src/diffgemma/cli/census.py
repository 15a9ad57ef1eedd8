"""`diffgemma census`: arms x batteries x seeds in one process, or `--analyze DIR` to re-report a campaign."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from diffgemma.cli.options import CliError, one_line_errors


def census(
    arms_file: str | None = typer.Option(
        None,
        "--arms",
        help="Arms file (JSON list or JSONL of {name, env, model, quantize}) or `demo` (default: one arm).",
    ),
    battery: list[str] = typer.Option(
        [],
        "--battery",
        help="smoke, longctx, programmatic, demo, ... or a JSONL path (repeatable).",
        show_default=False,
    ),
    seeds: str = typer.Option("0", "--seeds", help="Comma-separated canvas seeds, e.g. 0,1,2."),
    out: Path | None = typer.Option(
        None, "--out", help="Campaign directory to write (with --analyze: optional)."
    ),
    gate: Path | None = typer.Option(
        None, "--gate", help="Thresholds per metric (JSON); exit 1 if an arm fails."
    ),
    analyze: Path | None = typer.Option(
        None, "--analyze", help="Re-report this campaign directory, no model."
    ),
    model: str | None = typer.Option(
        None,
        "-m",
        "--model",
        help="Model directory or HF repo id of arms that name none (default: the demo).",
    ),
) -> None:
    """Run every arm over every battery and seed, writing per-reply records and a summary to --out; or re-report a
    campaign with --analyze. Every input is checked before any model loads."""
    from diffgemma.census import analyze as A
    from diffgemma.census import arms as arms_mod
    from diffgemma.census import batteries as B
    from diffgemma.census import campaign
    from diffgemma.census import gate as G

    with one_line_errors():
        spec = G.read(gate) if gate is not None else None
        if analyze is not None:
            if arms_file is not None or battery or model is not None:
                raise CliError("--analyze re-reports a campaign: it takes no --arms, --battery or --model", 2)
            summary = A.report(analyze, write_to=out)
            _compare(analyze, summary, A)
        else:
            if out is None:
                raise CliError("--out DIR is needed (the campaign's directory)", 2)
            if not battery:
                raise CliError(f"no --battery given (bundled: {', '.join(B.bundled_names())}; or a path)", 2)
            plan = campaign.Campaign(
                arms=arms_mod.read(arms_file) if arms_file is not None else [arms_mod.default_arm()],
                batteries=[B.load(name) for name in battery],
                seeds=_seeds(seeds),
                model=_model(model),
                out=out,
            )
            names = [b.name for b in plan.batteries]
            if len(set(names)) != len(names):
                raise CliError(f"two batteries of one name in {names}: the summary keys them by name", 2)
            campaign.check_out(out)
            summary = campaign.run(plan)
        sys.stdout.write(A.table(summary))
        if spec is not None:
            failed = G.failures(summary, spec)
            if failed:
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                raise CliError(f"gate failed: {failed[0]}{more}")
            print(
                f"diffgemma: gate passed ({len(spec)} thresholds, {len(summary['arms'])} arms)",
                file=sys.stderr,
            )


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise CliError(f"--seeds must be comma-separated integers, got {text!r}", 2) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise CliError(f"--seeds must list distinct integers, got {text!r}", 2)
    return seeds


def _model(model: str | None) -> Path:
    """--model, or the bundled demo model: a census compares arms of a model it names, never a discovered one."""
    from diffgemma.weights.download import bundled_model, resolve_model

    if model is not None:
        return resolve_model(model)
    demo = bundled_model()
    if demo is None:
        raise CliError("this build has no bundled demo model: pass --model DIR")
    return demo


def _compare(campaign_dir: Path, summary: dict, analyze_mod) -> None:
    """Say whether the campaign's own summary.json is what its records give now, byte for byte."""
    written = campaign_dir / "summary.json"
    if not written.exists():
        return
    same = written.read_text(encoding="utf-8") == analyze_mod.dumps(summary)
    verdict = "reproduced byte for byte" if same else "DIFFERS from what its records give now"
    print(f"diffgemma: {written} {verdict}", file=sys.stderr)
