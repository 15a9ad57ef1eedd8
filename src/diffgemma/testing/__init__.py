"""Factories for tiny checkpoints in the real on-disk format (tests and model-free demos)."""

from diffgemma.testing.checkpoint import write_tiny_checkpoint
from diffgemma.testing.tokenizer import build_tokenizer, write_tokenizer_files

__all__ = ["build_tokenizer", "write_tiny_checkpoint", "write_tokenizer_files"]
