"""Writing a pack (`diffgemma quantize`), and the pack's alignment rule.

A pack is a checkpoint directory: config.json with a `quantization_config`, the tokenizer and generation files
copied, and safetensors shards in which every tensor's data starts at a 64-byte-aligned file offset (the seed's
GPU rule: a misaligned typed read is silently wrong). safetensors allows no gaps between tensors, so the gaps
are tensors of their own, `__pad__.N` (uint8, zeros), which the loader skips. Layout: docs/quantization.md.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from diffgemma.quant import formats
from diffgemma.quant.profiles import QuantSpecError, resolve, tensor_class
from diffgemma.weights.header import read_header
from diffgemma.weights.overlay import Overlay

ALIGN = 64
PAD_PREFIX = "__pad__."
SHARD_BYTES = 4 << 30  # output shards of about 4 GiB, as the hub's checkpoints
COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def misaligned(path: Path) -> str | None:
    """The first tensor of `path` whose data does not start at a 64-byte-aligned file offset, or None."""
    header, start = read_header(path)
    for name, entry in header.items():
        if not name.startswith(PAD_PREFIX) and (start + entry["data_offsets"][0]) % ALIGN:
            return name
    return None


@dataclass
class Entry:
    """One stored tensor of a shard being written, and the source tensor it is encoded from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str = ""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header(entries: list[Entry]) -> tuple[bytes, list[int]]:
    """The aligned header for entries (pads inserted) and each entry's offset in the data section."""
    meta: dict[str, dict] = {}
    offsets, pos, pads = [], 0, 0
    for e in entries:
        gap = -pos % ALIGN
        if gap:
            meta[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            pads += 1
            pos += gap
        meta[e.name] = {
            "dtype": DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.nbytes],
        }
        offsets.append(pos)
        pos += e.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data section starts aligned too
    return raw, offsets


def write_aligned(path: Path, entries: list[Entry], produce: Callable[[Entry], torch.Tensor]) -> None:
    """A safetensors file of `entries`, each tensor's data 64-byte aligned, written in order: `produce(entry)`
    gives each tensor when its turn comes, so only one is in memory at a time."""
    raw, offsets = _header(entries)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        base = f.tell()
        for e, off in zip(entries, offsets, strict=True):
            f.write(b"\0" * (base + off - f.tell()))
            t = produce(e)
            if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise AssertionError(
                    f"{e.name}: produced {t.dtype} {tuple(t.shape)}, planned {e.dtype} {e.shape}"
                )
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def chunk(groups: list[list[Entry]]) -> list[list[Entry]]:
    """Groups of entries (a source tensor's) packed in order into shards of about SHARD_BYTES, a group never
    split across two; at least one shard, which may be empty."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entries in groups:
        n = sum(e.nbytes for e in entries)
        if size and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].extend(entries)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    """The hub's names for n shards: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_shards(
    directory: Path, shards: list[tuple[str, list[Entry]]], produce: Callable[[Entry], torch.Tensor]
) -> None:
    """Each (file name, entries) as an aligned safetensors file, and the index when there are several."""
    weight_map = {}
    for fname, entries in shards:
        write_aligned(directory / fname, entries, produce)
        weight_map.update(dict.fromkeys((e.name for e in entries), fname))
    if len(shards) > 1:
        total = sum(e.nbytes for _, entries in shards for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, dst: Path) -> None:
    """The generation config and tokenizer files a pack carries over from its source, where it has them."""
    for name in COPIED:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out`, renamed to `out` when the block completes and removed when it raises
    (Ctrl-C included), so that no partial `out` is ever left."""
    if out.exists():
        raise QuantSpecError(f"{out} already exists: pass a new directory")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- diffgemma quantize --------------------------------------------------------------------------------


@dataclass
class Plan:
    """What `quantize` will write: each source tensor's format, the pack's shards of entries, its config.json."""

    formats: dict[str, str]  # source tensor -> format
    shards: list[list[Entry]]
    sources: dict[str, Path]  # source tensor -> its file
    config: dict


def _source_tensors(src: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every source tensor's (file, safetensors dtype, shape), from the headers alone (each file's read once)."""
    from diffgemma.weights.loader import shard_files

    files = shard_files(src)
    headers = {}
    for path in set(files.values()):
        try:
            headers[path] = read_header(path)[0]
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return {n: (f, headers[f][n]["dtype"], tuple(headers[f][n]["shape"])) for n, f in files.items()}


def plan(src: Path, profile: str, overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """Resolve the profile and overrides and check every tensor against its format, from the source's config
    and headers only (no weight read). Raises QuantSpecError with one line on anything that cannot be done."""
    base, resolved, given = resolve(profile, overrides)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise QuantSpecError(f"{src} is already quantized: quantize from a bf16 checkpoint")
    fmts: dict[str, str] = {}
    groups: list[list[Entry]] = []
    sources = {}
    for name, (path, dtype, shape) in _source_tensors(src).items():
        if name.startswith(PAD_PREFIX):
            continue
        cls = tensor_class(name, len(shape))
        fmt = resolved.get(cls, "bf16") if cls is not None else "bf16"
        problem = formats.dims_problem(fmt, shape)
        if problem:
            raise QuantSpecError(f"tensor {name} {tuple(shape)} ({cls}) cannot be {fmt}: {problem}")
        fmts[name], sources[name] = fmt, path
        if fmt == "bf16":
            groups.append([Entry(name, TORCH_DTYPES[dtype], shape, name)])
        else:
            groups.append(
                [Entry(name + s, i.dtype, i.shape, name) for s, i in formats.layout(fmt, shape).items()]
            )
    config["quantization_config"] = {
        "quant_method": "diffgemma",
        "profile": base,
        "formats": resolved,
        "overrides": given,
    }
    return Plan(fmts, chunk(groups), sources, config)


class Progress:
    """One line on stderr, rewritten in place on a terminal: tensors and bytes done."""

    def __init__(self, total_bytes: int, quiet: bool = False, verb: str = "quantizing"):
        self.total, self.done, self.quiet, self.verb = total_bytes, 0, quiet, verb
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.t0 = time.monotonic()

    def step(self, nbytes: int, name: str) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.quiet or (now - self.last < 0.5 and self.done < self.total):
            return
        self.last = now
        pct = 100.0 * self.done / max(self.total, 1)
        line = f"{self.verb} {pct:5.1f}%  {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB  {name}"
        if self.tty:
            print("\r" + line[:120].ljust(120), end="", file=sys.stderr, flush=True)
        elif self.done >= self.total:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def _encode(t: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """`formats.encode`, a stacked [E, N, K] weight one expert at a time (bounded memory)."""
    if fmt == "bf16" or t.dim() < 3:
        return formats.encode(t, fmt)
    parts = [formats.encode(t[e], fmt) for e in range(t.shape[0])]
    return {s: torch.stack([p[s] for p in parts]) for s in parts[0]}


def quantize(
    src: str | Path,
    out: str | Path,
    profile: str,
    overrides: list[str] | tuple[str, ...] = (),
    quiet: bool = False,
    overlay: bool = False,
) -> Path:
    """Write the pack of checkpoint `src` at `out`: everything refusable is refused before `out` exists or a
    weight is read, and `out` appears only complete (`staged`). With `overlay`, the pack holds only the
    quantized tensors and references every raw one in `src`'s shards (weights/overlay.py)."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise QuantSpecError(f"{out} already exists: pass a new directory")
    p = plan(src, profile, overrides)
    layout = list(zip(shard_names(len(p.shards)), p.shards, strict=True))
    index = None
    if overlay:
        external = {n: p.sources[n].relative_to(src).as_posix() for n, f in p.formats.items() if f == "bf16"}
        index = Overlay.make(src, external, [(f, [e.name for e in es]) for f, es in layout])
        groups: dict[str, list[Entry]] = {}
        for e in (e for shard in p.shards for e in shard if e.source not in external):
            groups.setdefault(e.source, []).append(e)
        local = chunk(list(groups.values()))
        layout = list(zip(shard_names(len(local)), local, strict=True))
    progress = Progress(sum(e.nbytes for _, shard in layout for e in shard), quiet)
    with staged(out) as tmp:
        handles: dict[Path, object] = {}
        current: dict[str, torch.Tensor] = {}

        def produce(e: Entry) -> torch.Tensor:
            if e.name not in current:  # the first entry of a source tensor: encode it, drop the last one's
                current.clear()
                path = p.sources[e.source]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt", device="cpu")
                parts = _encode(handles[path].get_tensor(e.source), p.formats[e.source])
                current.update({e.source + s: v for s, v in parts.items()})
            progress.step(e.nbytes, e.name)
            return current.pop(e.name)

        write_shards(tmp, layout, produce)
        (tmp / "config.json").write_text(json.dumps(p.config, indent=2) + "\n")
        copy_side_files(src, tmp)
        if index is not None:
            index.write(tmp)
        progress.close()
    return out
