"""The results reported: a markdown table, progress lines on stderr, the JSON file and what it measured on."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def table(results: dict[str, Any], ctxs: list[int], other: str = "transformers") -> str:
    """The results as a markdown table, ours beside `other`'s when they are there."""
    ours, ref = results.get("diffgemma", {}), results.get(other)
    rows = [f"| metric | context | diffgemma | {other} | ratio |", "| --- | --- | --- | --- | --- |"]

    def row(metric, ctx, key, fmt, better_low):
        a = ours.get(key, {}).get(str(ctx))
        b = ref.get(key, {}).get(str(ctx)) if ref else None
        ratio = (b / a if better_low else a / b) if a and b else None
        rows.append(
            f"| {metric} | {ctx} | {fmt.format(a) if a else '-'} | {fmt.format(b) if b else '-'} | "
            f"{f'{ratio:.2f}x' if ratio else '-'} |"
        )

    for ctx in ctxs:
        row("denoise step ms", ctx, "denoise_step_ms", "{:.2f}", True)
    for ctx in ctxs:
        row("prefill tok/s", ctx, "prefill_tok_s", "{:,.0f}", False)
    ga, gb = ours.get("generate_block_s"), (ref or {}).get("generate_block_s")
    rows.append(
        f"| generate one block s | - | {ga and f'{ga:.3f}' or '-'} | {gb and f'{gb:.3f}' or '-'} | "
        f"{f'{gb / ga:.2f}x' if ga and gb else '-'} |"
    )
    pa, pb = ours.get("peak_gib"), (ref or {}).get("peak_gib")
    rows.append(f"| peak GiB | - | {pa and f'{pa:.1f}' or '-'} | {pb and f'{pb:.1f}' or '-'} | - |")
    return "\n".join(rows)


def log(msg: str) -> None:
    """A progress line on stderr, from the first rank only under torch.distributed."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def save(results: dict[str, Any], out: str | None, device: torch.device | None = None) -> None:
    """`results` as JSON at `out` (when given), with their `provenance` on `device`."""
    if out:
        write_json(out, results, device)


PACKAGE = Path(__file__).resolve().parents[1]  # src/diffgemma in a checkout


def _git(*args: str) -> str | None:
    """A git command's output in this package's checkout; None without git or outside a checkout."""
    try:
        done = subprocess.run(
            ["git", "-C", str(PACKAGE), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def source_commit() -> tuple[str | None, bool | None]:
    """The commit of the checkout this package runs from (`git rev-parse HEAD`) and whether its tracked files differ
    from it (untracked files not counted); (None, None) for an installed copy, whose directory no checkout holds
    as its src/diffgemma (a virtual environment inside another repository is not that repository's code)."""
    top = _git("rev-parse", "--show-toplevel")
    if not top or (Path(top) / "src" / "diffgemma").resolve() != PACKAGE:
        return None, None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def provenance(device: torch.device | None = None) -> dict[str, Any]:
    """What a result measured: the code (commit, dirty, diffgemma's version), the software (Python, torch, Triton,
    the CUDA torch was built with) and the device's name (`device`, default the current CUDA device if any, else
    the CPU). Every JSON file `diffgemma bench` and the scripts in bench/ write carries it."""
    from diffgemma import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or device.type
    )
    commit, dirty = source_commit()
    return {
        "commit": commit,
        "dirty": dirty,
        "diffgemma": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": name,
        "device_type": device.type,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(
    path: str | Path, doc: dict[str, Any], device: torch.device | None = None, indent: int = 2
) -> Path:
    """Write a result as JSON, its `provenance` (on `device`) first; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": provenance(device), **doc}, indent=indent) + "\n")
    return path
