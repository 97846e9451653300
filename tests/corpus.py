"""Deterministic English-like text for long-prompt tests (the generator lives in the package, where
`kvflash bench` uses it too)."""
from kvflash_ggml.bench.prose import prose

__all__ = ["prose"]
