"""The results reported: a markdown table, progress lines on stderr, the JSON file."""

from __future__ import annotations

import json
import sys
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


def save(results: dict[str, Any], out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
