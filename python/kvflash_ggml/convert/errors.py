"""The one error type of the converter: every message says what is wrong and where."""
from __future__ import annotations

from types import ModuleType


class ConversionError(Exception):
    """A checkpoint that cannot be converted, or an output that must not be written."""


def require_gguf() -> ModuleType:
    """The `gguf` package, imported when a conversion needs it, so that a missing package is one clear
    ConversionError rather than an ImportError traceback from `import kvflash_ggml.convert`."""
    try:
        import gguf
    except ImportError as e:
        raise ConversionError(f"the converter needs the `gguf` package, which cannot be imported ({e}); "
                              f"install it with: pip install gguf") from None
    return gguf
