"""The package's version, at the bottom of the layers: the op log's header records it."""

__version__ = "0.1.0"
