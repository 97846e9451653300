"""kvflash bench niah: passkey / needle-in-a-haystack recall vs residency (see bench/retrieval)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from .retrieval import cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.main("niah", argv)


if __name__ == "__main__":
    sys.exit(main())
