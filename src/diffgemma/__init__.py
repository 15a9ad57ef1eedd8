"""diffgemma: an inference engine for DiffusionGemma, the block-diffusion Gemma 4 MoE."""

from pathlib import Path

from diffgemma.config import ModelConfig, RuntimeConfig, SamplerConfig
from diffgemma.engine.engine import Engine, load
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session.client import Session


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
    "demo_model",
    "load",
]
__version__ = "0.1.0"
