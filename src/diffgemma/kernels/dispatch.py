"""The one gate to the Triton kernels and the one fallback when a call into them fails.

A Triton module (`diffgemma.kernels.triton_*`) is imported on first use, never at startup, and only for CUDA
tensors; a module whose call has failed once (a compile error, say) is off for the rest of the process, with one
line on stderr, and the caller's next implementation serves: a library kernel or the torch reference.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, for tests without a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

failed: set[str] = set()  # Triton modules switched off by a failed call


@functools.cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"diffgemma.kernels.{name}")
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken or too old triton: the next implementation, loudly
        print(f"diffgemma: triton unusable ({type(e).__name__}: {e}); torch kernels instead", file=sys.stderr)
        return None


def triton(name: str, x: torch.Tensor | None = None) -> ModuleType | None:
    """The Triton module `diffgemma.kernels.<name>` when it can serve a call on `x` (a CUDA tensor), else None:
    triton missing or broken, or the module failed before. (The interpreter's tests call the modules directly.)"""
    if x is not None and not x.is_cuda:
        return None
    return None if name in failed else _import(name)


def fall_back(name: str, error: Exception) -> None:
    """Switch the Triton module `name` off after a failed call, with one line on stderr."""
    failed.add(name)
    msg = str(error).splitlines()[0] if str(error) else ""
    print(
        f"diffgemma: Triton {name} failed ({type(error).__name__}: {msg}); torch path instead",
        file=sys.stderr,
    )


def attempt(name: str, call: Callable[[ModuleType], Any], x: torch.Tensor | None = None) -> Any:
    """`call(module)` through the gate: its result, or None when the module cannot serve or the call failed
    (then switched off for good)."""
    module = triton(name, x)
    if module is None:
        return None
    try:
        return call(module)
    except Exception as e:  # noqa: BLE001 - any failure: the next implementation from then on, loudly
        fall_back(name, e)
        return None
