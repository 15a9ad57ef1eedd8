"""The token pipeline (seed Part III): one worker owns the model and every KV cache, clients send it ops of token
ids and read back events; stages (the op log, the tool stages) wrap it. `Conversation` is one cached token log."""

from diffgemma.session.conversation import Conversation, common_prefix

__all__ = ["Conversation", "common_prefix"]
