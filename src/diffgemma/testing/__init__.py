"""Factories for tiny checkpoints in the real on-disk format (tests and model-free demos)."""

from diffgemma.testing.checkpoint import write_tiny_checkpoint

__all__ = ["write_tiny_checkpoint"]
