"""The one place where an op's implementation is chosen: a fast op (a Triton kernel, else a library kernel or a
compiled region) or its torch reference, and the one fallback when a call into a Triton kernel fails.

A run's choice (`fast_kernels`) is made once, by the runner, which builds the model's steps from it
(`model.steps.FastSteps` or the reference `Steps`). On the fast path each call then asks here whether a Triton
kernel takes it (`triton`, `attempt`: a CUDA tensor, triton importable, the module not switched off, the caller's
`fits` for the kernel's shapes and dtypes) and whether its activations send it to the reference steps (`wide`).
The sampler's row pass asks the same gate. Adding a kernel touches two files: its `triton_*.py` and the op that
calls it through `attempt` (`kernels/library.py` or `model/steps.py`); nothing here lists the kernels.

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

from diffgemma.quant.weight import QuantWeight

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, for tests without a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

failed: set[str] = set()  # Triton modules switched off by a failed call


def fast_kernels(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """A run's choice between the fast ops and the torch reference (`RuntimeConfig.kernels`): "fast",
    "reference", or "auto", which is fast on CUDA in 16 bits."""
    if setting == "auto":
        return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return setting == "fast"


def wide(x: torch.Tensor, weight: torch.Tensor | QuantWeight) -> bool:
    """fp32 activations on 16-bit (or quantized) weights (a short prompt's prefill, seed rule 7): the fast steps
    take the reference ones there, but for attention and the experts (their kernels take fp32 activations)."""
    return x.dtype == torch.float32 and (isinstance(weight, QuantWeight) or weight.dtype != torch.float32)


@functools.cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"diffgemma.kernels.{name}")
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken or too old triton: the next implementation, loudly
        print(f"diffgemma: triton unusable ({type(e).__name__}: {e}); torch kernels instead", file=sys.stderr)
        return None


def triton(name: str, x: torch.Tensor | None = None, fits: bool = True) -> ModuleType | None:
    """The Triton module `diffgemma.kernels.<name>` when it can serve a call on `x` (a CUDA tensor) that `fits` its
    kernels, else None: triton missing or broken, or the module failed before. (The interpreter's tests call the
    modules directly.)"""
    if not fits or (x is not None and not x.is_cuda):
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


def attempt(
    name: str, call: Callable[[ModuleType], Any], x: torch.Tensor | None = None, fits: bool = True
) -> Any:
    """`call(module)` through the gate (`triton`): its result, or None when the module cannot serve or the call
    failed (then switched off for good)."""
    module = triton(name, x, fits)
    if module is None:
        return None
    try:
        return call(module)
    except Exception as e:  # noqa: BLE001 - any failure: the next implementation from then on, loudly
        fall_back(name, e)
        return None
