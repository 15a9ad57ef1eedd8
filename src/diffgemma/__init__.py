"""diffgemma: an inference engine for DiffusionGemma, the block-diffusion Gemma 4 MoE."""

import os as _os
import sys as _sys

# Idle CPU threads sleep instead of spinning (runner/devices.py, "OpenMP wait policy"); torch's OpenMP reads it once,
# as torch loads, so it is set before the first import of torch here, and never over a value of the user's.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

from diffgemma.config import ModelConfig, RuntimeConfig, SamplerConfig
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session.client import Engine, Session, load
from diffgemma.version import __version__


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
