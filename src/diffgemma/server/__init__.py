"""OpenAI-compatible HTTP server for diffgemma (`diffgemma serve`)."""

from diffgemma.server.app import create_app
from diffgemma.server.run import serve

__all__ = ["create_app", "serve"]
