"""diffgemma: an inference engine for DiffusionGemma, the block-diffusion Gemma 4 MoE."""

import os as _os
import sys as _sys

# Idle CPU threads sleep instead of spinning (runner/devices.py, "OpenMP wait policy"); torch's OpenMP reads it once,
# as torch loads, so it is set before the first import of torch here, and never over a value of the user's.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

from diffgemma.config import ModelConfig, RuntimeConfig, SamplerConfig
from diffgemma.version import __version__

# The names that need torch load on first use (PEP 562): `import diffgemma`, and the command line's help and the
# errors it finds before loading a model, skip torch's import (over a second of CPU: issue 57's one-line errors)
_FROM_ENGINE = ("CancelToken", "GenerateOutput", "StepInfo")
_FROM_SESSION = ("Engine", "Session", "load")


def __getattr__(name: str):
    if name in _FROM_ENGINE:
        from diffgemma.engine import generate as module
    elif name in _FROM_SESSION:
        from diffgemma.session import client as module
    else:
        raise AttributeError(f"module 'diffgemma' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later lookups find it without this function
    return value


def demo_model() -> Path:
    """The bundled demo model's directory, for `load` (FileNotFoundError when this build ships none)."""
    from diffgemma.weights.download import bundled_model  # the one place that knows where it lives

    path = bundled_model()
    if path is None:
        raise FileNotFoundError("this build of diffgemma has no bundled demo model (assets/demo)")
    return path


__all__ = [
    "CancelToken",
    "Engine",
    "GenerateOutput",
    "ModelConfig",
    "RuntimeConfig",
    "SamplerConfig",
    "Session",
    "StepInfo",
    "__version__",
    "demo_model",
    "load",
]
