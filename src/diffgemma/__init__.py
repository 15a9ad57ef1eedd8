"""diffgemma: an inference engine for DiffusionGemma, the block-diffusion Gemma 4 MoE."""

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
