"""Merge retrieval reports (kvflash bench niah/ruler --json) of runs over disjoint cases into one, print its
table and the case-by-case comparison with the full cache, and write the merged JSON (and plot).

For a grid split across device calls: e.g. the full cell and a pooled cell of one task set from two runs,
then another task set with both in a third run. Cells of one (length, policy, pool) are concatenated in
the order the files are given.

  python scripts/merge_reports.py a.json b.json c.json --json merged.json [--plot merged.png]
"""
import argparse
import json
import sys

from kvflash_ggml.bench.retrieval.grid import format_paired, format_table, merge_reports, write_json, write_plot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", default="")
    ap.add_argument("--group", choices=["task", "depth"], default="task")
    args = ap.parse_args()
    merged = merge_reports([json.load(open(p)) for p in args.reports])
    print(format_table(merged, "by_" + args.group))
    print(format_paired(merged, args.group))
    write_json(merged, args.json)
    if args.plot and not write_plot(merged, args.plot):
        print("matplotlib is not installed: no plot written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
