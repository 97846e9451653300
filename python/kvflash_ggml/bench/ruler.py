"""kvflash bench ruler: RULER-style recall vs residency (multi-key, multi-value, multi-query needles,
variable tracking, common words; see bench/retrieval)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from .retrieval import cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.main("ruler", argv)


if __name__ == "__main__":
    sys.exit(main())
