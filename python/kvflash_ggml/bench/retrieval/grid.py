"""The grid runner: context lengths x pool sizes x policies, plus the full-cache control.

Policies are passed through to Model(policy=...) untouched (a name or a callable), so a policy the
engine learns later needs nothing here. One Model per (pool, policy), sized for the longest case and
reused for every length; every case starts from an empty session (scoring.reset). Cells where the
pool holds the whole context are skipped: they would measure the full cache again.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from ... import _core
from ...engine import make_policy
from ...model import Model
from .cases import Case, Renderer
from .scoring import run_case

Policy = Union[str, Callable]


@dataclass(frozen=True)
class Config:
    policy: Policy
    pool: Optional[int]                       # None = full cache (the control)
    prefill_reselect: Optional[bool] = None   # None = the engine's default; True adds "+pf" to the label
    tau: Optional[int] = None                 # None = the engine's default
    drafter_model: Optional[str] = None       # the drafter policy's model (unused by other policies)
    prefill: Optional[str] = None             # None = the engine's default (auto); "pooled" / "sparse" add "+pooled" / "+sparse"
    kv_type: Optional[str] = None             # None = PoolConfig's default; the control's too
    attention: Optional[str] = None           # None = PoolConfig's default; the control's too

    @property
    def label(self) -> str:
        if self.pool is None:
            return "full"
        return policy_label(self.policy) + ("+pf" if self.prefill_reselect else "") + \
            (f"+{self.prefill}" if self.prefill in ("pooled", "sparse") else "")

    def model_options(self) -> dict:
        """Keywords for Model (which builds PoolConfig and ResidencyConfig from them) beyond pool and policy:
        only those chosen, so the dataclasses' defaults rule; the control takes no residency options."""
        residency = {"prefill_reselect": self.prefill_reselect, "tau": self.tau, "prefill": self.prefill,
                     "drafter_model": self.drafter_model if self.policy == "drafter" else None}
        opts = {"kv_type": self.kv_type, "attention": self.attention, **(residency if self.pool is not None else {})}
        return {k: v for k, v in opts.items() if v is not None}


def policy_label(policy: Policy) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "__name__", type(policy).__name__)


def reselects(policy: Policy) -> bool:
    """Whether the engine would ask this policy to reselect (unknown names: assume so, and let
    check_configs report them)."""
    try:
        return bool(make_policy(policy).reselects)
    except ValueError:
        return True


def make_configs(pools: Sequence[int], policies: Sequence[Policy], *, include_full: bool = True,
                 prefill_reselect: Sequence[Optional[bool]] = (None,), tau: Optional[int] = None,
                 drafter_model: Optional[str] = None, prefill: Sequence[Optional[str]] = (None,),
                 kv_type: Optional[str] = None, attention: Optional[str] = None) -> list[Config]:
    """The full-cache control first (its recall B is what every pooled cell is judged against), then
    every pool x policy x prefill-reselect variant x prefill mode; a policy that never reselects gets one
    prefill-reselect variant."""
    pool_options = dict(kv_type=kv_type, attention=attention)
    out = [Config("lru", None, **pool_options)] if include_full else []
    for pool in pools:
        for p in policies:
            variants = prefill_reselect if reselects(p) else (None,)
            out += [Config(p, pool, pf, tau, drafter_model, mode, **pool_options)
                    for mode in prefill for pf in variants]
    return out


def open_model(model_path: str, cfg: Config, n_ctx: int, n_threads: Optional[int], backend: str = "auto"):
    return Model(model_path, n_ctx=n_ctx, pool_tokens=cfg.pool, policy=cfg.policy, n_threads=n_threads,
                 backend=backend, **cfg.model_options())


def check_configs(model_path: str, cfgs: Sequence[Config], n_ctx: int, n_threads: Optional[int],
                  backend: str = "auto") -> None:
    """Construct every configuration once before the long run, so an unknown policy or a bad pool
    fails in a second, not after an hour of cells. Raises ValueError naming the configuration."""
    for cfg in cfgs:
        try:
            open_model(model_path, cfg, n_ctx, n_threads, backend).close()
        except (ValueError, RuntimeError) as e:
            what = "full cache" if cfg.pool is None else f"policy {cfg.label!r} with pool {cfg.pool}"
            raise ValueError(f"{what}: {e}") from None


@dataclass
class Prepared:
    length: int                  # the nominal length the cases were made for (or "jsonl" bucket size)
    case: Case
    prompt: list[int]
    answer: list[int]


def prepare(cases_by_length: dict[int, list[Case]], renderer: Renderer) -> list[Prepared]:
    out = []
    for length, cases in cases_by_length.items():
        for case in cases:
            prompt = renderer.tokens(case)
            out.append(Prepared(length, case, prompt, renderer.answer_tokens(case, prompt)))
    return out


def context_for(items: Sequence[Prepared]) -> int:
    """n_ctx that holds the longest prompt plus its answer budget, in whole chunks."""
    need = max(len(p.prompt) + max(p.case.max_new_tokens, len(p.answer)) for p in items)
    return -(-need // _core.CHUNK_TOKENS) * _core.CHUNK_TOKENS


def run_grid(model_path: str, cases_by_length: dict[int, list[Case]], renderer: Renderer, cfgs: Sequence[Config], *,
             n_threads: Optional[int] = None, backend: str = "auto",
             log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
             meta: Optional[dict] = None, on_cell: Optional[Callable[[dict], None]] = None) -> dict:
    """Run every case under every configuration; returns the report (cells with per-case results).
    on_cell(report so far) is called after each cell, so a long run can save partial results."""
    items = prepare(cases_by_length, renderer)
    n_ctx = context_for(items)
    check_configs(model_path, cfgs, n_ctx, n_threads, backend)
    report = {**(meta or {}), "model": model_path, "format": renderer.fmt, "n_ctx": n_ctx, "threads": n_threads,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "lengths": list(cases_by_length),
              "configs": [{"policy": c.label, "pool": c.pool, **c.model_options()} for c in cfgs],
              "cases": {str(length): [c.to_json() for c in cs] for length, cs in cases_by_length.items()},
              "cells": []}
    for cfg in cfgs:
        llm = open_model(model_path, cfg, n_ctx, n_threads, backend)
        try:
            for length in cases_by_length:
                if cfg.pool is not None and cfg.pool >= length:
                    log(f"skip {cfg.label} pool {cfg.pool} at length {length}: the pool holds the whole context")
                    continue
                batch = [p for p in items if p.length == length]
                report["cells"].append(run_cell(llm, cfg, length, batch, log))
                if on_cell:
                    on_cell(report)
        finally:
            llm.close()
    return report


STAT_KEYS = ("page_outs", "page_ins", "bytes_moved", "reselects", "time_paging_ms", "time_scoring_ms")


def run_cell(llm, cfg: Config, length: int, batch: Sequence[Prepared], log: Callable[[str], None]) -> dict:
    before = llm.stats()
    results = []
    for i, p in enumerate(batch):
        r = run_case(llm.engine, p.prompt, p.answer, p.case)
        results.append({"task": p.case.task, "depth": p.case.meta.get("depth"), "answers": p.case.answers,
                        **r.to_json()})
        log(f"{cfg.label:>6} pool {cfg.pool or '-':>5} len {length:>6} case {i + 1:>3}/{len(batch)} "
            f"{p.case.task:<10} depth {p.case.meta.get('depth')} score {r.score:.2f} tf {r.tf:.2f} "
            f"{r.seconds:6.1f}s  {r.output.strip()[:60]!r}")
    after = llm.stats()
    stats = {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in STAT_KEYS}
    stats["device_peak_bytes"] = after.get("device_peak_bytes", 0)   # every device byte the cell held at once
    return make_cell(length, cfg.label, cfg.pool, results, stats)


def make_cell(length: int, policy: str, pool: Optional[int], results: list[dict], stats: dict) -> dict:
    """A cell of the report: its per-case results and what they add up to."""
    n = len(results)
    return {
        "length": length, "policy": policy, "pool": pool,
        "residency": 1.0 if pool is None else pool / length,
        "n": n, "recall": sum(r["score"] for r in results) / n, "tf": sum(r["tf"] for r in results) / n,
        "by_task": group_mean(results, "task"), "by_depth": group_mean(results, "depth"),
        "seconds": round(sum(r["seconds"] for r in results), 1), "stats": stats, "results": results,
    }


def group_mean(results: Sequence[dict], key: str) -> dict:
    groups: dict[str, list[float]] = {}
    for r in results:
        if r.get(key) is not None:
            groups.setdefault(str(r[key]), []).append(r["score"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def merge_reports(reports: Sequence[dict]) -> dict:
    """One report from runs over disjoint cases (a grid split across machines or time limits): cells of
    the same (length, policy, pool) are concatenated in the order given, so a pooled cell stays case by
    case beside the full cell when every run held both or the runs pair up in order."""
    cells: dict[tuple, dict] = {}
    cases: dict[str, list] = {}
    for rep in reports:
        for length, cs in rep.get("cases", {}).items():
            held = cases.setdefault(length, [])
            held += [c for c in cs if c not in held]   # runs that repeat a cell's cases list them once
        for c in rep["cells"]:
            key = (c["length"], c["policy"], c["pool"])
            into = cells.setdefault(key, {"results": [], "stats": {}})
            into["results"] += c["results"]
            for k, v in c["stats"].items():
                held = into["stats"].get(k, 0)
                into["stats"][k] = max(held, v) if k.endswith("peak_bytes") else round(held + v, 3)
    first = reports[0]
    return {**{k: first[k] for k in ("bench", "model", "format", "n_ctx", "threads") if k in first},
            "commands": [r.get("command") for r in reports], "dates": [r.get("date") for r in reports],
            "lengths": sorted({l for r in reports for l in r["lengths"]}), "cases": cases,
            "cells": [make_cell(l, p, pool, c["results"], c["stats"]) for (l, p, pool), c in cells.items()]}


# -- output ----------------------------------------------------------------------------------------

def mib(n: Optional[int]) -> str:
    return f"{n / 2**20:.0f}" if n else "-"


def format_table(report: dict, group: str = "by_task") -> str:
    """One row per (length, configuration): recall, teacher-forced accuracy, recall relative to the
    full cache at that length (x B), the device bytes held at once (weights, pool, compute buffers, the prefill
    workspace, a drafter), then recall per task or per depth."""
    cells = report["cells"]
    groups = sorted({g for c in cells for g in c[group]}, key=_group_order)
    full = {c["length"]: c["recall"] for c in cells if c["pool"] is None}
    head = f"| length | policy | pool | residency | recall | x B | teacher-forced | n | device MiB |"
    head += "".join(f" {g} |" for g in groups)
    lines = [head, "|" + "---:|" * (9 + len(groups))]
    for c in sorted(cells, key=lambda c: (c["length"], c["pool"] is not None, c["pool"] or 0, c["policy"])):
        b = full.get(c["length"])
        xb = f"{c['recall'] / b:.2f}" if b else "-"
        row = (f"| {c['length']} | {c['policy']} | {c['pool'] or '-'} | {100 * c['residency']:.1f}% | "
               f"{c['recall']:.3f} | {xb} | {c['tf']:.3f} | {c['n']} | {mib(c['stats'].get('device_peak_bytes'))} |")
        row += "".join(f" {c[group][g]:.2f} |" if g in c[group] else " - |" for g in groups)
        lines.append(row)
    return "\n".join(lines)


def format_paired(report: dict, key: str = "task") -> str:
    """Case by case against the full cache at the same length, per task (or depth): how many cases a
    pooled cell scores higher (+) and lower (-). Recall differences of a few cases are mostly near ties
    flipping both ways; this shows which. Cells that did not run the full cell's cases are left out."""
    cases_of = lambda results: [(r["task"], r["answers"]) for r in results]
    full = {c["length"]: (c["results"], cases_of(c["results"])) for c in report["cells"] if c["pool"] is None}
    lines = []
    for c in report["cells"]:
        ref, ref_cases = full.get(c["length"], (None, None))
        if c["pool"] is None or ref is None or cases_of(c["results"]) != ref_cases:
            continue
        counts: dict[str, list[int]] = {}
        for a, b in zip(ref, c["results"]):
            n = counts.setdefault(str(a.get(key)), [0, 0])
            n[0] += b["score"] > a["score"]
            n[1] += b["score"] < a["score"]
        groups = sorted(counts, key=_group_order)
        lines.append(f"{c['policy']} pool {c['pool']} len {c['length']} vs full: " +
                     ", ".join(f"{g} +{counts[g][0]}/-{counts[g][1]}" for g in groups))
    return "\n".join(lines)


def _group_order(g: str):
    try:
        return (0, float(g), "")
    except ValueError:
        return (1, 0.0, g)


def write_json(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


def write_plot(report: dict, path: str) -> bool:
    """Recall (free generation, and teacher-forced) vs residency; one line per (policy, length),
    the full-cache control as a dashed level per length. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    cells = report["cells"]
    lengths = sorted({c["length"] for c in cells})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, title in ((axes[0], "recall", "free greedy generation"), (axes[1], "tf", "teacher-forced")):
        for i, length in enumerate(lengths):
            color = colors[i % len(colors)]
            for c in cells:
                if c["length"] == length and c["pool"] is None:
                    ax.axhline(c[key], color=color, ls="--", lw=1)
                    ax.plot([100], [c[key]], marker="*", ms=11, color=color, ls="", label=f"full cache, {length}")
            policies = sorted({c["policy"] for c in cells if c["length"] == length and c["pool"] is not None})
            bases = sorted({p.split("+")[0] for p in policies})
            for pol in policies:
                # one marker per policy; its variants (+pf, +exact) dotted with hollow markers
                base, variant = pol.split("+")[0], "+" in pol
                pts = sorted((100 * c["residency"], c[key]) for c in cells
                             if c["length"] == length and c["policy"] == pol and c["pool"] is not None)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="os^vD*"[bases.index(base) % 6],
                        color=color, ls=":" if variant else "-", mfc="none" if variant else color,
                        label=f"{pol}, {length}")
        ax.set_xscale("log")
        lo = min(100 * c["residency"] for c in cells)
        ax.set_xlim(lo / 1.3, 130)
        ax.set_xticks([t for t in (0.78125, 1.5625, 3.125, 6.25, 12.5, 25, 50, 100) if lo / 1.3 <= t <= 130])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("residency (pool / context, %)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("recall")
    axes[0].set_ylim(-0.03, 1.03)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{report.get('bench', 'retrieval')}: {Path(report['model']).name}, {report['format']} prompts")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
