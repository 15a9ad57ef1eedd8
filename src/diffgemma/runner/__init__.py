"""Execution of the model: `ModelRunner` (kernels, prefill routes, CUDA graphs, warm-up) and its devices."""

from diffgemma.runner.runner import ModelRunner

__all__ = ["ModelRunner"]
