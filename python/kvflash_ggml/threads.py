"""How many CPU threads a model computes with when the user does not say (n_threads=None, no --threads).

ggml's CPU threads are OpenMP threads that meet at a barrier after every graph node, and a waiting thread spins
(OpenMP's default: up to ~3 ms) before it sleeps. On cores that another process keeps busy, a thread of ours is
descheduled at a barrier while its partner spins, and a 2-thread decode ran 30-80x slower than one thread. Measured
on the 2-core dev VM (SmolLM2, full cache, 32-token decodes, median tok/s of interleaved runs: python -m
kvflash_ggml.bench.threads, the first line under chrt -f 50):

    cores free (ours run first: SCHED_FIFO)   2 threads 85, 1 thread 59, 2 threads with OMP_WAIT_POLICY=passive 32
    beside a busy process (load ~4)           2 threads 2.6, 1 thread 25, 2 threads passive 28, this default 31 (1)

A passive wait (sleep at once) fixes the shared case but costs 2.7x when the cores are free (each barrier then
waits for a wake-up), so it is not the default. Instead the default thread count leaves out the cores other
processes keep busy, sampled over SAMPLE_SECONDS when the model loads. Work that starts later is not seen: on
cores shared with it, pass n_threads=1 (--threads 1) or set OMP_WAIT_POLICY=passive before the first import."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 0.1


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_seconds_busy() -> Optional[float]:
    """Seconds every core of the machine spent busy since boot (/proc/stat), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)   # idle + iowait
    busy = sum(ticks[:8]) - idle                              # guest time is already inside user
    return busy / os.sysconf("SC_CLK_TCK")


def busy_cores_of_others(seconds: float = SAMPLE_SECONDS) -> Optional[float]:
    """The cores other processes kept busy over `seconds` (this process's own CPU time left out), or None where
    the machine does not say."""
    busy0, own0, t0 = _cpu_seconds_busy(), time.process_time(), time.monotonic()
    if busy0 is None:
        return None
    time.sleep(seconds)
    busy1, own1, t1 = _cpu_seconds_busy(), time.process_time(), time.monotonic()
    return max(0.0, ((busy1 or busy0) - busy0 - (own1 - own0)) / (t1 - t0))


def free_cores(cores: int, busy: Optional[float]) -> int:
    """Cores left for us: a core counts as taken when other processes use more than half of one."""
    if busy is None:
        return cores
    return max(1, min(cores, cores - int(busy + 0.5)))


def default_threads(sample: Callable[[], Optional[float]] = busy_cores_of_others) -> int:
    cores = usable_cores()
    busy = sample() if cores > 1 else None
    n = free_cores(cores, busy)
    if n < cores:
        log.info("n_threads: %d of %d cores (other processes keep %.1f busy; ggml's threads would wait on theirs); "
                 "pass n_threads to choose", n, cores, busy)
    return n


def cpu_threads(n_threads: Optional[int], sample: Callable[[], Optional[float]] = busy_cores_of_others) -> int:
    """The thread count for _core.Model: n_threads as given, more threads than cores clamped (with a warning:
    oversubscribed threads wait on each other, 10-70x slower); None / 0: default_threads()."""
    if n_threads is None or n_threads == 0:
        return default_threads(sample)
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 0:
        raise ValueError(f"n_threads must be a positive integer or None (the free cores), got {n_threads!r}")
    cores = usable_cores()
    if n_threads > cores:
        log.warning("n_threads=%d is more than the %d CPU cores; using %d (oversubscribed threads are many "
                    "times slower)", n_threads, cores, cores)
        return cores
    return n_threads
