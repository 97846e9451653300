"""kvflash bench merge: merge retrieval reports (kvflash bench niah/ruler --json) of runs over disjoint cases
into one, print its table and the case-by-case comparison with the full cache, and write the merged JSON
(and plot).

For a grid split across device calls: e.g. the full cell and a pooled cell of one task set from two runs,
then another task set with both in a third run. Cells of one (length, policy, pool) are concatenated in
the order the files are given.

  kvflash bench merge a.json b.json c.json -o merged.json [--plot merged.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .retrieval.grid import format_paired, format_table, merge_reports, write_json, write_plot


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="REPORT", help="JSON reports of kvflash bench niah / ruler")
    ap.add_argument("-o", "--output", required=True, help="where to write the merged JSON")
    ap.add_argument("--plot", default="", help="where to write the PNG ('' = none)")
    ap.add_argument("--group", choices=["task", "depth"], default="task", help="table rows (default task)")
    args = ap.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    merged = merge_reports(reports)
    print(format_table(merged, "by_" + args.group))
    print(format_paired(merged, args.group))
    write_json(merged, args.output)
    if args.plot and not write_plot(merged, args.plot):
        print("matplotlib is not installed: no plot written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
