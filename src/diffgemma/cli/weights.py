"""`diffgemma download`, `quantize` and `repack`: a checkpoint fetched from the hub, a pack written or repacked."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from diffgemma.cli.options import MODEL, CliError, one_line_errors


def download(
    repo: str = typer.Option("google/diffusiongemma-26B-A4B-it", "--repo", help="Hub repo, ORG/NAME."),
    revision: str | None = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    out: Path | None = typer.Option(None, "-o", "--out", help="Target directory (default: the HF cache)."),
) -> None:
    """Download a checkpoint or pack (safetensors, configs, tokenizer) from the Hugging Face Hub; an interrupted
    run resumes, and the directory is printed only once every file matches the hub's size and sha256."""
    import shlex

    from diffgemma.weights.download import DEFAULT_REPO, VerifyError
    from diffgemma.weights.download import download as fetch

    flags = {"--repo": None if repo == DEFAULT_REPO else repo, "--revision": revision, "-o": out}
    again = "diffgemma download" + "".join(f" {k} {shlex.quote(str(v))}" for k, v in flags.items() if v)
    with one_line_errors():
        try:
            path = fetch(repo, revision, out)
        except VerifyError as e:
            raise CliError(f"{e}: run `{again}` to fetch it again") from None
        except KeyboardInterrupt:
            raise CliError(f"interrupted: run `{again}` to resume", 130) from None
        except Exception as e:  # hub errors come in many classes, some of several lines: one line here
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            status = getattr(getattr(e, "response", None), "status_code", None) or 500
            final = isinstance(e, FileNotFoundError) or (400 <= status < 500 and status not in (408, 429))
            resume = "" if final else f"; run `{again}` to resume"  # no retry helps a 404 or a missing token
            raise CliError(f"download of {repo} failed: {why}{resume}") from None
        print(path)


def quantize(
    model: str | None = MODEL,
    out: Path = typer.Option(..., "-o", "--out", help="The pack's directory (must not exist)."),
    profile: str = typer.Option(
        "int4", "--profile", help="int4 (the default), q5, q6, q8, fp8, nvfp4, nvfp4x (int4, experts nvfp4)."
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="CLASS=FORMAT on top of the profile: experts, experts.gate_up, experts.down, attn, "
        "dense, sc, vision = bf16, q8, int4, q5, q6, fp8, nvfp4.",
        show_default=False,
    ),
    overlay: bool = typer.Option(
        False,
        "--overlay",
        help="Write only the quantized tensors; every raw one stays a pinned reference into the source's "
        "shards. Local tooling for experiment arms, never a pack to distribute.",
    ),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress line."),
) -> None:
    """Write a quantized pack of a checkpoint: one tensor at a time, into a directory renamed into place at the end."""
    from diffgemma.quant.profiles import QuantSpecError
    from diffgemma.weights.download import resolve_model
    from diffgemma.weights.pack import quantize as write_pack

    with one_line_errors():
        try:
            path = write_pack(resolve_model(model), out, profile, overrides, quiet=quiet, overlay=overlay)
        except QuantSpecError as e:
            raise CliError(str(e), code=2) from None
        except KeyboardInterrupt:
            raise CliError(f"interrupted; no {out} was written", code=130) from None
        print(path)


def repack(
    model: str = typer.Option(..., "-m", "--model", help="The pack (--overlay) or overlay (--monolithic)."),
    out: Path = typer.Option(..., "-o", "--out", help="The new directory (must not exist)."),
    overlay: bool = typer.Option(
        False, "--overlay", help="Split a self-contained pack into an overlay on --base."
    ),
    monolithic: bool = typer.Option(
        False, "--monolithic", help="Flatten an overlay into a self-contained pack."
    ),
    base: str | None = typer.Option(
        None,
        "--base",
        help="--overlay: the checkpoint the pack was quantized from (a directory or HF repo id).",
    ),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress line."),
) -> None:
    """Split a pack into an overlay (its raw tensors verified byte for byte against the base and referenced there,
    any that differ stored) or flatten an overlay back. Overlays are local tooling for experiment arms, never a pack
    to distribute; an overlay's base comes from its overlay.json, or DIFFGEMMA_OVERLAY_BASE."""
    from diffgemma.quant.profiles import QuantSpecError
    from diffgemma.weights.download import resolve_model
    from diffgemma.weights.overlay import OverlayError
    from diffgemma.weights.repack import flatten, split

    with one_line_errors():
        if overlay == monolithic:
            raise CliError("repack: pass exactly one of --overlay and --monolithic", code=2)
        if monolithic and base is not None:
            raise CliError(
                "repack --monolithic takes no --base: the overlay records its base (DIFFGEMMA_OVERLAY_BASE "
                "overrides it)",
                code=2,
            )
        if overlay and base is None:
            raise CliError(
                "repack --overlay needs --base, the checkpoint the pack was quantized from", code=2
            )
        try:
            if overlay:
                path, n, differ = split(resolve_model(model), out, resolve_model(base), quiet=quiet)
                note = f"; {len(differ)} differ from the base's bytes, e.g. {differ[0]}" if differ else ""
                print(f"diffgemma: {n} tensors referenced in the base{note}", file=sys.stderr)
            else:
                from diffgemma.config import load_runtime_config

                path = flatten(resolve_model(model), out, load_runtime_config().overlay_base, quiet=quiet)
        except QuantSpecError as e:
            raise CliError(str(e), code=2) from None
        except OverlayError as e:
            raise CliError(str(e)) from None
        except KeyboardInterrupt:
            raise CliError(f"interrupted; no {out} was written", code=130) from None
        print(path)
