"""Fuzz of the snapshot loader (issue 5): at least 10,000 mutated or truncated snapshots.

Every case goes to Session.load_bytes (into a live session) and every 8th also to Session.from_bytes
(a new session built from the saved config). Each must either load, leaving a session that passes the
pager's invariant check, or raise SnapshotError; any other exception fails the test, and a crash or a
hang (caught by faulthandler's watchdog) fails the run. Most mutants are resealed with a valid checksum,
and many are rebuilt section by section with consistent lengths, so they reach the section parsers
instead of stopping at the checksum. The snapshots come from a tiny random-weight model with 16-token
chunks, so a case costs well under a millisecond. KVFLASH_FUZZ_CASES raises the count (ASan runs). A quarter
as many again go to a sliding-window model's snapshots (format version 2, with the rings' section).
"""
import faulthandler
import os
import struct
import time

import numpy as np
import pytest

from kvflash_ggml import _core

N_CASES = int(os.environ.get("KVFLASH_FUZZ_CASES", "10000"))
WATCHDOG_S = 600
# n_batch 32: a sliding-window model's rings (window 40) have 128 rows and wrap within the 159 tokens saved
CONFIG = dict(max_tokens=256, pool_tokens=128, chunk_tokens=16, kv_type="f16", track_summaries=True, n_batch=32)
INTERESTING = [0, 1, 2, 7, 8, 15, 16, 63, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1,
               -1, -2, -16, -(2**31), -(2**63)]


def base_snapshots(model):
    """Snapshots that use every part of the format: eviction, host-only chunks, a shuffled block order,
    scores with a NaN, a pin ahead of the head, a partial head chunk, chunk summaries, a prefix, an
    empty session."""
    rng = np.random.default_rng(0)
    s = _core.Session(model, _core.SessionConfig(**CONFIG))
    _core.testing.set_block_order(s, rng.permutation(s.pager.n_blocks()).tolist())
    s.forward(rng.integers(0, 1000, 150).astype(np.int32), 0)
    scores = rng.random(s.pager.n_chunks()).astype(np.float32)
    scores[2] = np.nan
    s.reselect(scores)
    s.pin(200, 208)   # chunk 12, ahead of the head
    s.forward(rng.integers(0, 1000, 9).astype(np.int32), s.n_tokens)
    empty = _core.Session(model, _core.SessionConfig(**CONFIG))
    # a prefix: old for a dense model, within the rings' reach for a sliding-window one
    prefix = s.n_tokens // 16 if s.ring_tokens else 3
    return [s.to_bytes(), s.to_bytes(prefix_chunks=prefix), empty.to_bytes()]


def seal(body: bytes) -> bytes:
    return body + int(_core.snapshot_checksum(body + bytes(8))).to_bytes(8, "little")


def sections(data: bytes):
    out, off = [], 16
    for _ in range(int.from_bytes(data[12:16], "little")):
        tag, version, length = struct.unpack_from("<4sIQ", data, off)
        out.append([tag, version, bytearray(data[off + 16: off + 16 + length])])
        off += 16 + length
    return out


def format_version(data: bytes) -> int:
    return struct.unpack_from("<I", data, 8)[0]


def build(secs, version=1) -> bytes:
    body = b"KVFSNAP\0" + struct.pack("<II", version, len(secs))
    body += b"".join(struct.pack("<4sIQ", t, v, len(p)) + bytes(p) for t, v, p in secs)
    return seal(body)


def mutate_bytes(buf: bytearray, rng, region: int) -> None:
    """Flip, overwrite with an interesting integer, insert or delete, mostly within buf[:region]."""
    for _ in range(rng.integers(1, 4)):
        hi = max(1, region if rng.random() < 0.85 else len(buf))
        at = int(rng.integers(0, hi))
        kind = rng.integers(0, 4)
        if kind == 0 and buf:
            buf[min(at, len(buf) - 1)] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            width = int(rng.choice([1, 4, 8]))
            v = int(rng.choice(INTERESTING)) % (1 << (8 * width))
            buf[at:at + width] = v.to_bytes(width, "little")
        elif kind == 2:
            buf[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        else:
            del buf[at:at + int(rng.integers(1, 9))]


def mutant(base: bytes, rng) -> bytes:
    kind = rng.integers(0, 6)
    if kind == 0:                                   # truncated, as a short read would leave it
        return base[:int(rng.integers(0, len(base)))]
    if kind == 1:                                   # truncated, then resealed
        return seal(base[:int(rng.integers(16, len(base) - 8))])
    if kind == 2:                                   # raw byte damage, checksum left stale
        buf = bytearray(base)
        mutate_bytes(buf, rng, len(buf))
        return bytes(buf)
    secs, version = sections(base), format_version(base)
    if kind == 3:                                   # one section's payload damaged, lengths kept consistent
        sec = secs[int(rng.integers(0, len(secs)))]
        mutate_bytes(sec[2], rng, min(len(sec[2]), 256))
        return build(secs, version)
    if kind == 4:                                   # the section list: drop, duplicate, swap, retag, re-version
        i, j = (int(x) for x in rng.integers(0, len(secs), 2))
        op = rng.integers(0, 5)
        if op == 0:
            del secs[i]
        elif op == 1:
            secs.insert(j, [secs[i][0], secs[i][1], bytearray(secs[i][2])])
        elif op == 2:
            secs[i], secs[j] = secs[j], secs[i]
        elif op == 3:
            secs[i][0] = bytes(rng.integers(0, 256, 4, dtype=np.uint8))
        else:
            secs[i][1] = int(rng.choice(INTERESTING)) % 2**32
        return build(secs, version=version if rng.random() < 0.9 else int(rng.integers(0, 4)))
    buf = bytearray(base[:-8])                      # whole-file damage near the front, resealed
    mutate_bytes(buf, rng, 512)
    return seal(bytes(buf))


@pytest.fixture(scope="module")
def sliding_window_gguf(tmp_path_factory):
    from kvflash_ggml.testing import random_gguf as rg

    return str(rg.write_preset(tmp_path_factory.mktemp("fuzz") / "gemma3.gguf", "tiny-gemma3", n_swa=40))


@pytest.mark.parametrize("family,n_cases", [("dense", N_CASES), ("sliding-window", N_CASES // 4)])
def test_fuzzed_snapshots_load_or_raise_snapshot_error(tiny_gguf, sliding_window_gguf, family, n_cases):
    model = _core.Model(tiny_gguf() if family == "dense" else sliding_window_gguf, backend="cpu", n_threads=1)
    bases = base_snapshots(model)
    assert all(format_version(b) == (1 if family == "dense" else 2) for b in bases)
    target = _core.Session(model, _core.SessionConfig(**CONFIG))
    for b in bases:   # the unmutated ones load
        target.load_bytes(b)
        target.pager.check_invariants()
    rng = np.random.default_rng(int(os.environ.get("KVFLASH_FUZZ_SEED", "1234")))
    outcomes = {"loaded": 0, "rejected": 0}
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)   # a hang kills the run with a traceback
    t0 = time.perf_counter()
    try:
        for i in range(n_cases):
            data = mutant(bases[int(rng.integers(0, len(bases)))], rng)
            loaders = [target.load_bytes] + ([lambda d: _core.Session.from_bytes(model, d)] if i % 8 == 0 else [])
            for load in loaders:
                try:
                    restored = load(data) or target
                except _core.SnapshotError:
                    outcomes["rejected"] += 1
                    continue
                except Exception as e:   # noqa: BLE001 - any other kind is the bug this test looks for
                    pytest.fail(f"case {i}: {type(e).__name__}: {e}")
                outcomes["loaded"] += 1
                restored.pager.check_invariants()
                assert len(restored.tokens) == restored.n_tokens
    finally:
        faulthandler.cancel_dump_traceback_later()
    dt = time.perf_counter() - t0
    print(f"\nsnapshot fuzz ({family}): {n_cases} cases ({outcomes['loaded']} loads, {outcomes['rejected']} "
          f"rejections) in {dt:.1f} s")
    assert outcomes["rejected"] > n_cases // 2 and outcomes["loaded"] > 0
    # the live target still works after all of it
    target.load_bytes(bases[0])
    target.forward(np.array([1], np.int32), target.n_tokens)
    target.pager.check_invariants()
