"""`diffgemma repack`: a self-contained pack split into an overlay on its base checkpoint (`split`), and an overlay
flattened back into a self-contained pack (`flatten`); one tensor in memory at a time, nothing requantized."""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from diffgemma.quant.profiles import QuantSpecError
from diffgemma.weights.header import read_header
from diffgemma.weights.overlay import Overlay, OverlayError
from diffgemma.weights.pack import (
    PAD_PREFIX,
    TORCH_DTYPES,
    Entry,
    Progress,
    chunk,
    copy_side_files,
    shard_names,
    staged,
    write_shards,
)

CHUNK = 8 << 20  # bytes compared at a time


@dataclass(frozen=True)
class Stored:
    """A tensor as a safetensors header places it: its file, dtype name, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def stored(files: list[Path]) -> dict[str, Stored]:
    """Every tensor of these safetensors files but the pads, file by file in data order."""
    out = {}
    for f in files:
        try:
            header, start = read_header(f)
        except ValueError as e:
            raise OverlayError(f"{f}: {e}") from None
        for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if not name.startswith(PAD_PREFIX):
                b, e = h["data_offsets"]
                out[name] = Stored(f, h["dtype"], tuple(h["shape"]), start + b, start + e)
    return out


def _checkpoint_files(directory: Path) -> list[Path]:
    from diffgemma.weights.loader import shard_files

    return sorted(set(shard_files(directory).values()))


def _same_bytes(a: Stored, b: Stored, handles: dict[Path, object]) -> bool:
    """Whether two stored tensors hold the same dtype, shape and bytes (read CHUNK bytes at a time)."""
    if (a.dtype, a.shape, a.end - a.begin) != (b.dtype, b.shape, b.end - b.begin):
        return False
    fa, fb = handles[a.file], handles[b.file]
    for off in range(0, a.end - a.begin, CHUNK):
        n = min(CHUNK, a.end - a.begin - off)
        fa.seek(a.begin + off)
        fb.seek(b.begin + off)
        if fa.read(n) != fb.read(n):
            return False
    return True


def _entry(name: str, s: Stored) -> Entry:
    dtype = TORCH_DTYPES.get(s.dtype)
    if dtype is None:
        raise OverlayError(f"tensor {name} in {s.file} has dtype {s.dtype}, which a pack does not hold")
    return Entry(name, dtype, s.shape, name)


def _reader(where: dict[str, Stored], stack: ExitStack, progress: Progress):
    """produce() for write_shards: each entry's tensor read from the file that holds it."""
    handles: dict[Path, object] = {}

    def produce(e: Entry) -> torch.Tensor:
        f = where[e.name].file
        if f not in handles:
            handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        progress.step(e.nbytes, e.name)
        return handles[f].get_tensor(e.name)

    return produce


def split(
    pack: str | Path, out: str | Path, base: str | Path, quiet: bool = False
) -> tuple[Path, int, list[str]]:
    """An overlay at `out` of the self-contained pack `pack` on the checkpoint `base`: every tensor whose dtype,
    shape and bytes equal the base's tensor of that name is referenced there, every other one stored. Returns
    (out, tensors referenced, the tensors stored although the base has one of that name, dtype and shape)."""
    pack, out, base = Path(pack), Path(out), Path(base)
    if Overlay.read(pack) is not None:
        raise QuantSpecError(f"{pack} is an overlay already (repack --monolithic flattens it)")
    qc = json.loads((pack / "config.json").read_text()).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "diffgemma":
        raise QuantSpecError(f"{pack} is not a diffgemma pack (diffgemma quantize writes one)")
    if Overlay.read(base) is not None:
        raise QuantSpecError(f"the base {base} is an overlay: pass the checkpoint its shards live in")
    if out.exists():
        raise QuantSpecError(f"{out} already exists: pass a new directory")
    mine, theirs = stored(_checkpoint_files(pack)), stored(_checkpoint_files(base))
    layout: dict[Path, list[str]] = {}
    for name, s in mine.items():
        layout.setdefault(s.file, []).append(name)
    external, differ = {}, []
    progress = Progress(sum(s.end - s.begin for s in mine.values()), quiet, verb="verifying")
    with ExitStack() as stack:
        files = {s.file for s in (*mine.values(), *theirs.values())}
        handles = {f: stack.enter_context(open(f, "rb")) for f in files}
        for name, s in mine.items():
            b = theirs.get(name)
            if b is not None and _same_bytes(s, b, handles):
                external[name] = b.file.relative_to(base).as_posix()
            elif b is not None and (b.dtype, b.shape) == (s.dtype, s.shape):
                differ.append(name)
            progress.step(s.end - s.begin, name)
    progress.close()
    local = chunk([[_entry(n, s)] for n, s in mine.items() if n not in external])
    index = Overlay.make(base, external, [(f.name, names) for f, names in layout.items()])
    progress = Progress(sum(e.nbytes for shard in local for e in shard), quiet, verb="writing")
    with staged(out) as tmp, ExitStack() as stack:
        write_shards(
            tmp, list(zip(shard_names(len(local)), local, strict=True)), _reader(mine, stack, progress)
        )
        shutil.copyfile(pack / "config.json", tmp / "config.json")
        copy_side_files(pack, tmp)
        index.write(tmp)
        progress.close()
    return out, len(external), differ


def flatten(
    overlay: str | Path, out: str | Path, base: str | Path | None = None, quiet: bool = False
) -> Path:
    """The self-contained pack of overlay `overlay` at `out`, in the layout the overlay records (that of the pack
    it was made from or would have been): each tensor's bytes from the overlay or its base (`base` overrides the
    recorded one), every base shard checked against its pin first."""
    overlay, out = Path(overlay), Path(out)
    index = Overlay.read(overlay)
    if index is None:
        raise QuantSpecError(f"{overlay} is not an overlay (it has no overlay.json): it is self-contained")
    if out.exists():
        raise QuantSpecError(f"{out} already exists: pass a new directory")
    shards = index.resolve(overlay, base)
    where = stored(_checkpoint_files(overlay))
    local = set(where)
    theirs = stored(sorted(set(shards.values())))
    for name, f in shards.items():
        if name not in theirs or theirs[name].file != f:
            raise OverlayError(f"overlay {overlay}: tensor {name} is not in base shard {f}")
        where.setdefault(name, theirs[name])
    laid = [n for _, names in index.layout for n in names]
    missing = [n for n in laid if n not in where]
    unplaced = sorted(local - set(laid))
    if missing or unplaced:
        what = (
            f"tensor {missing[0]} is neither stored nor referenced"
            if missing
            else (f"stored tensor {unplaced[0]} has no place in its layout")
        )
        raise OverlayError(f"overlay {overlay}: {what}")
    layout = [(f, [_entry(n, where[n]) for n in names]) for f, names in index.layout]
    progress = Progress(sum(e.nbytes for _, es in layout for e in es), quiet, verb="writing")
    with staged(out) as tmp, ExitStack() as stack:
        write_shards(tmp, layout, _reader(where, stack, progress))
        shutil.copyfile(overlay / "config.json", tmp / "config.json")
        copy_side_files(overlay, tmp)
        progress.close()
    return out
