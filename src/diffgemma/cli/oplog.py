"""`diffgemma replay` and `golden`: a logged session re-executed, the golden paths diffed."""

from __future__ import annotations

from pathlib import Path

import typer

from diffgemma.cli.options import THREADS, CliError, one_line_errors


def replay(
    log: Path = typer.Argument(
        ..., help="An op log (ask/chat --log FILE, serve --log-dir DIR: DIR/ops.jsonl)."
    ),
    model: str | None = typer.Option(None, "-m", "--model", help="Model (default: the one the log names)."),
    device: str | None = typer.Option(None, "--device", help="Default: the log's."),
    dtype: str | None = typer.Option(None, "--dtype", help="Default: the log's."),
    threads: int | None = THREADS,
) -> None:
    """Re-execute a logged session and compare every event: exit 0 when identical, 1 at the first difference."""
    import diffgemma
    from diffgemma.config import load_runtime_config
    from diffgemma.session.oplog import read_log
    from diffgemma.session.oplog import replay as replay_log
    from diffgemma.weights.download import resolve_model

    with one_line_errors():
        if not log.is_file():
            raise CliError(f"{log}: no such log", 2)
        sessions = read_log(log)
        first = sessions[0].header
        path = resolve_model(model or first.get("model"))
        runtime = load_runtime_config(
            device=device or first.get("device"),
            dtype=dtype or first.get("dtype"),
            threads=threads,
            batch_invariant=first.get("batch_invariant"),
        )
        engine = diffgemma.load(path, max_tokens=first.get("ctx"), runtime=runtime)
        same, line = replay_log(log, engine)
        print(line)
        if not same:
            raise typer.Exit(1)


def golden(
    bless: bool = typer.Option(False, "--bless", help="Record the paths anew (after a deliberate change)."),
    model: str | None = typer.Option(None, "-m", "--model", help="Default: the bundled demo model."),
) -> None:
    """The refactor gate: replay the golden session paths on the demo model (CPU, fp32) and diff every event."""
    import diffgemma
    from diffgemma.session import golden as G
    from diffgemma.weights.download import bundled_model, resolve_model

    with one_line_errors():
        path = resolve_model(model) if model else bundled_model()
        if path is None:
            raise CliError("this build has no bundled demo model: pass -m", 2)
        engine = diffgemma.load(path, device="cpu", dtype="float32", threads=1)
        if bless:
            print(f"recorded {len(G.PATHS)} paths into {G.bless(engine)}")
            return
        same, line = G.check(engine)
        print(line)
        if not same:
            raise typer.Exit(1)
