"""A safetensors file's header, read without its data: the one parser behind the download check, the pack's
alignment rule and quantize's plan."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 << 20  # safetensors' own cap; a larger "length" is a corrupt file, not a header


def header_bytes(path: Path) -> bytes:
    """The file's first 8 + n bytes: the header's 8-byte length n and its JSON, unparsed. Raises ValueError when
    the length does not fit the file."""
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors file")
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} does not fit the file's {size} bytes")
        return head + f.read(n)


def read_header(path: Path) -> tuple[dict, int]:
    """The header (tensor name -> dtype, shape, data_offsets; no `__metadata__`) and the file offset the data
    starts at. Raises ValueError saying what is wrong when the file is no safetensors file."""
    raw = header_bytes(path)
    try:
        header = json.loads(raw[8:])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, len(raw)
