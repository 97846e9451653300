"""`kvflash bench decode --max-device-memory SIZE` (issue 37 item 4): decode within a device-memory budget, ours beside
llama.cpp at the largest context llama.cpp runs within the same budget.

Ours: at each depth the pool is the product's own fit under the budget (fit.resolve_pool, as `kvflash generate
--max-device-memory` sizes it), and while the depth runs (engine, prefill, decode) the memory in use on each GPU is
sampled from the driver (total less free: every allocation of every process, our CUDA context included): its peak
must be within the budget. On the CPU backend there is no driver to ask; the engine's own count stands in.

llama.cpp has no budget to obey, so the largest depth it runs within one is found by measurement, never by a formula:
one llama-bench process per depth tried (same GGUF, every layer offloaded, flash attention, its default f16 KV), its
own footprint (memory in use on each GPU above what was in use before it started) sampled while it runs, and the
process stopped as soon as that passes the budget. Depths are tried from the largest down: memory grows with the
context, so the first that fits is the largest of the bench's; then, if asked, bisected between it and the next
larger depth. A llama-bench that fails (e.g. out of memory on a GPU no larger than the budget) did not run within
the budget either; its message is kept."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from .. import _core
from .reference import llama_bench_command, median_ts, progress

GIB = float(1 << 30)
SAMPLE_INTERVAL_S = 0.005   # as bench prefill's sampler: a step of a large model lasts longer than this
RELEASE_SLACK = 64 << 20    # in use again after a process ended: within this of before it started
RELEASE_TIMEOUT_S = 60.0
FITS, OVER, FAILED = "fits", "over the budget", "failed"

Reading = Callable[[], dict]   # () -> {device name: bytes in use}


def gpu_used_by_device() -> dict:
    """{GPU name: bytes in use now}, the driver's view (total less free), for every local GPU."""
    return {d["name"]: d["memory_total"] - d["memory_free"] for d in _core.gpu_devices()}


def above(before: dict, used: dict) -> Optional[int]:
    """A process's own footprint: the most any device has in use (`used`) above what it had in use before the
    process started (None where there is no device)."""
    return max((n - before.get(name, 0) for name, n in used.items()), default=None)


def gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


class PeakSampler:
    """The most memory in use on each device (read()) while the block runs, sampled on a thread: the measured code
    releases the GIL while it computes, so the thread sees the peaks of its steps."""

    def __init__(self, read: Reading = gpu_used_by_device, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.read, self.interval_s, self.peak = read, interval_s, {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        for name, used in self.read().items():
            self.peak[name] = max(self.peak.get(name, 0), used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakSampler":
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def verdict(peak_by_device: dict, budget: int, source: str) -> dict:
    """The JSON a row keeps of a peak: per device, the largest, and whether every device stayed within the budget
    (max_device_bytes caps each device)."""
    peak = max(peak_by_device.values(), default=0)
    return {"peak_bytes_by_device": dict(peak_by_device), "peak_bytes": peak, "within_budget": peak <= budget,
            "peak_source": source}


# ---- llama.cpp: one process per depth tried --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Watched:
    """A process run under a budget: exit status (None: stopped by us), its own peak footprint on the device where it
    was largest, whether it passed the budget, its stdout, the end of its stderr."""
    returncode: Optional[int]
    peak_bytes: int
    over: bool
    stdout: str
    stderr_tail: str


def watch(cmd: Sequence[str], budget: int, read: Reading = gpu_used_by_device,
          interval_s: float = SAMPLE_INTERVAL_S, release_timeout_s: float = RELEASE_TIMEOUT_S) -> Watched:
    """Run cmd, sampling its footprint (in use above what was in use when it started, per device); stop it once the
    footprint passes `budget` (what it would take next is not ours to wait for). Returns once the driver shows its
    memory given back, so the next process starts from the same floor. Output goes to files: a pipe left unread
    while we sample would fill and stall it."""
    before = read()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, text=True)
        peak, over = 0, False
        while True:
            done = proc.poll() is not None
            own = above(before, read()) or 0
            peak = max(peak, own)
            if own > budget and not done:
                proc.kill()
                over = True
                break
            if done:
                break
            time.sleep(interval_s)
        proc.wait()
        _wait_for_release(before, read, release_timeout_s)
        out.seek(0)
        err.seek(0)
        return Watched(None if over else proc.returncode, peak, over, out.read(), err.read()[-2000:])


def _wait_for_release(before: dict, read: Reading, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(used <= before.get(name, 0) + RELEASE_SLACK for name, used in read().items()):
            return
        time.sleep(0.1)
    progress(f"the driver still shows memory in use {timeout_s:.0f} s after llama-bench ended: the next attempt's "
             "footprint is measured above that")


@dataclasses.dataclass(frozen=True)
class Attempt:
    """llama-bench at one depth under the budget: FITS (ran to the end within it, tok_s its decode rate), OVER
    (stopped when its footprint passed the budget; peak_bytes is what it had reached then) or FAILED (ended with an
    error of its own: message)."""
    depth: int
    status: str
    peak_bytes: int
    tok_s: Optional[float] = None
    message: str = ""

    @property
    def fits(self) -> bool:
        return self.status == FITS


def largest_fitting(depths: Sequence[int], attempt: Callable[[int], Attempt], *, bisect_steps: int = 0,
                    granularity: int = 1024) -> tuple[Optional[Attempt], list[Attempt]]:
    """The attempt at the largest depth that fits, and every attempt in the order made. The depths are tried from the
    largest down and the first that fits ends the scan (footprint grows with the context, so a smaller one fits
    too); then bisect_steps more depths (multiples of granularity) between the largest fitting depth (0 when none
    fit) and the smallest one above it that did not."""
    tried: list[Attempt] = []
    best: Optional[Attempt] = None
    above: Optional[int] = None
    for depth in sorted(set(depths), reverse=True):
        a = attempt(depth)
        tried.append(a)
        if a.fits:
            best = a
            break
        above = depth
    lo = best.depth if best else 0
    for _ in range(bisect_steps if above is not None else 0):
        mid = (lo + above) // 2 // granularity * granularity
        if mid <= lo or mid >= above:   # nothing left between them at this granularity
            break
        a = attempt(mid)
        tried.append(a)
        if a.fits:
            best, lo = a, mid
        else:
            above = mid
    return best, tried


def llama_attempt(binary: str, model_path: str, depth: int, *, n_gen: int, threads: int, reps: int,
                  split: Sequence[str], budget: int, read: Reading = gpu_used_by_device) -> Attempt:
    """llama-bench -p 0 -n n_gen -d depth (GPU: -ngl 99 -fa 1, its default f16 KV) watched under the budget."""
    progress(f"llama-bench -d {depth}: running under a budget of {gib(budget)} GiB (its own footprint, sampled)")
    test = ["-p", "0", "-n", str(n_gen), "-d", str(depth), *split]
    w = watch(llama_bench_command(binary, model_path, test, threads, True, reps), budget, read)
    if w.over:
        a = Attempt(depth, OVER, w.peak_bytes, message=f"stopped at {gib(w.peak_bytes)} GiB")
    elif w.returncode != 0:
        lines = [line for line in w.stderr_tail.splitlines() if line.strip()]
        a = Attempt(depth, FAILED, w.peak_bytes, message=f"exit {w.returncode}: {lines[-1] if lines else ''}")
    else:
        try:
            records = [r for r in json.loads(w.stdout) if int(r["n_depth"]) == depth]
        except (ValueError, TypeError, KeyError) as e:   # ran within the budget, but no rate to show for it
            records, w_error = [], f"its output is not llama-bench's JSON ({e})"
        else:
            w_error = ""
        a = Attempt(depth, FITS, w.peak_bytes, tok_s=median_ts(records[0]) if records else None, message=w_error)
    progress(f"llama-bench -d {depth}: {describe(a)}")
    return a


def describe(a: Attempt) -> str:
    if a.fits:
        rate = f"{a.tok_s:.1f} tok/s" if a.tok_s is not None else \
            f"no rate: {a.message or 'its depth not in its output'}"
        return f"fits, peak {gib(a.peak_bytes)} GiB, {rate}"
    return f"does not fit: {a.status} ({a.message})"


def llama_in_budget(binary: str, model_path: str, depths: Sequence[int], *, n_gen: int, threads: int, reps: int,
                    split: Sequence[str], budget: int, bisect_steps: int, granularity: int = 1024,
                    read: Reading = gpu_used_by_device) -> dict:
    """The JSON of the llama.cpp side: every attempt, and the largest depth that fit with its decode rate."""
    best, tried = largest_fitting(
        depths, lambda d: llama_attempt(binary, model_path, d, n_gen=n_gen, threads=threads, reps=reps, split=split,
                                        budget=budget, read=read), bisect_steps=bisect_steps, granularity=granularity)
    return {"attempts": [dataclasses.asdict(a) for a in tried], "largest_fitting_depth": best.depth if best else None,
            "tok_s": best.tok_s if best else None}


def llama_cell(llama: Optional[dict], depth: int) -> str:
    """What the budget table says of llama.cpp at a bench depth: its rate where it ran within the budget, 'does not
    fit' where it passed it (or failed), '-' where it was not run (a larger depth fit)."""
    if llama is None:
        return "-"
    for a in llama["attempts"]:
        if a["depth"] == depth:
            if a["status"] == FITS:
                return f"{a['tok_s']:.1f}" if a["tok_s"] is not None else "fits"
            return "does not fit" if a["status"] == OVER else "failed"
    largest = llama["largest_fitting_depth"]
    return "does not fit" if largest is None or depth > largest else "-"


def print_budget_table(report: dict) -> None:
    """One row per depth: the pool the fit chose, our peak and whether it is within the budget, our decode rate and
    its ratio to the first depth's (flatness), and llama.cpp's; then llama.cpp's attempts."""
    b = report["budget"]
    budget = b["max_device_bytes"]
    print(f"within max_device_bytes {budget} ({gib(budget)} GiB) per device; peak: {b['peak_source']}")
    print(f"{'depth':>7} {'pool':>7} {'peak GiB':>9} {'within':>7} {'pooled tok/s':>13} {'vs first':>9} "
          f"{'llama.cpp tok/s':>16}")
    first = report["rows"][0]["pooled"]["tok_s"] if report["rows"] else None
    for r in report["rows"]:
        p = r["pooled"]
        within = "yes" if p["within_budget"] else "NO"
        print(f"{r['depth']:>7} {r['pool_tokens']:>7} {gib(p['peak_bytes']):>9} {within:>7} "
              f"{p['tok_s']:>13.1f} {p['tok_s'] / first:>8.2f}x {llama_cell(b.get('llama'), r['depth']):>16}")
    for r in report["rows"]:
        if r.get("full_refused"):   # the fit's own words: what the full cache would need there
            print(f"depth {r['depth']}: our full cache does not fit: {r['full_refused']}")
    llama = b.get("llama")
    if llama is None:
        return
    for a in llama["attempts"]:
        print(f"llama-bench -d {a['depth']}: {describe(Attempt(**a))}")
    largest = llama["largest_fitting_depth"]
    print("llama.cpp's footprint: its own (in use above what was in use before it started), sampled every "
          f"{SAMPLE_INTERVAL_S * 1e3:.0f} ms; largest depth within the budget: "
          + (f"{largest} ({llama['tok_s']:.1f} tok/s)" if largest is not None and llama["tok_s"] is not None else
             f"{largest}" if largest is not None else "none of those tried"))
