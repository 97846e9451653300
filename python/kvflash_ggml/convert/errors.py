"""The one error type of the converter: every message says what is wrong and where."""
from __future__ import annotations


class ConversionError(Exception):
    """A checkpoint that cannot be converted, or an output that must not be written."""
