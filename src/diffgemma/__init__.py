"""diffgemma: an inference engine for DiffusionGemma, the block-diffusion Gemma 4 MoE."""

from diffgemma.config import ModelConfig, RuntimeConfig, SamplerConfig
from diffgemma.engine.engine import Engine, load
from diffgemma.engine.generate import CancelToken, GenerateOutput, StepInfo
from diffgemma.session.client import Session

__all__ = [
    "CancelToken",
    "Engine",
    "GenerateOutput",
    "ModelConfig",
    "RuntimeConfig",
    "SamplerConfig",
    "Session",
    "StepInfo",
    "load",
]
__version__ = "0.1.0"
