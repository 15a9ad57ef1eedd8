"""Programmatic dependent launch (Hopper and later). A kernel launched with `launch_pdl=True` may be scheduled
while the kernel before it on the stream drains, which hides its launch and the predecessor's last wave; it
must not touch memory before `start`'s wait, which returns once the predecessor has finished and its writes
are visible (at once when there is nothing to wait for). A CUDA graph keeps these launches as programmatic
edges."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from diffgemma.kernels.dispatch import INTERPRET


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (their PDL constexpr and `launch_pdl`)."""
    return not INTERPRET and device.type == "cuda" and _capable(device.index or 0)  # the interpreter: no PTX


@triton.jit
def start(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the predecessor, then let the next kernel be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
