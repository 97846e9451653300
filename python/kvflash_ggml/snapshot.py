"""Snapshots from Python: the on-disk multi-turn prefix cache, and the names users catch.

The bytes are the C++ core's business (cpp/snapshot/snapshot.h): each stateful piece (Session, KvPager,
PooledKV) writes its own versioned section, and the core adds the model fingerprint, the token history
and a checksum, writes through a temporary file renamed into place, and validates a whole file before
changing a session. From Python that is `Session.save(path, prefix_chunks=None)`, `Session.to_bytes()`,
`Session.load(path)` / `load_bytes(data)` (in place) and `Session.restore(model, path)` /
`Session.from_bytes(model, data)` (a new session with the saved config). This module composes those
into the prefix cache an Engine uses across turns and processes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from . import _core

SnapshotError = _core.SnapshotError   # a ValueError; unreadable or unwritable files raise OSError
DEFAULT_PREFIX_CACHE_BYTES = 4 << 30
SUFFIX = ".kvf"
STALE_TMP_SECONDS = 3600              # a temporary file this old belongs to a writer that died
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600   # a snapshot's token section is the conversation itself

log = logging.getLogger(__name__)


def snapshot_info(path: Union[str, os.PathLike]) -> dict:
    """Header facts of a snapshot file (format version, model fingerprint, n_tokens, geometry), after
    checking its container and checksum."""
    return _core.snapshot_file_info(path)


def session_key(session: _core.Session, model: _core.Model) -> str:
    """What a cached snapshot must share with a session to load into it: the model, the geometry that
    the KV bytes and the ledger depend on (max_tokens may differ), whether it carries summaries, the
    size of a sliding-window model's rings (window + n_batch: snapshots load only into the same), and whether
    it runs the multi-token-prediction head (its K/V and carry are in the snapshot)."""
    c, pc = session.config, session.pager.config()
    text = (f"{model.fingerprint}|{c.kv_type}|{pc.chunk_tokens}|{pc.pool_tokens}|{pc.sink_chunks}|{pc.tail_chunks}|"
            f"{c.track_summaries}")
    if session.ring_tokens:   # only then, so that dense models keep the keys their caches were stored under
        text += f"|ring{session.ring_tokens}"
    if session.mtp:   # likewise
        text += "|mtp"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _token_digests(tokens: Sequence[int], lengths: set[int]) -> dict[int, str]:
    """blake2b of tokens[:n] (as int32 bytes) for every n in lengths, in one pass."""
    arr = np.asarray(tokens, dtype="<i4")
    h = hashlib.blake2b(digest_size=16)
    out, done = {}, 0
    for n in sorted(lengths):
        h.update(arr[done:n].tobytes())
        done = n
        out[n] = h.hexdigest()
    return out


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    n_tokens: int
    digest: str


class PrefixCache:
    """Chunk-aligned prefixes of past turns on disk, one snapshot file each, named
    `{session key}-{n_tokens}-{digest of the tokens}.kvf`. The directory is the index (nothing to get out
    of step after a crash); a file's mtime is its last use, and the least recently used files go first
    when the directory holds more than max_bytes. Several processes may share a directory: every file
    appears by an atomic rename, and a file that vanishes or fails to load is a miss.

    A file's tokens are the conversation, so the cache is private: a folder it creates is 0700 and each file
    it stores (or uses) is made 0600. A folder that exists already keeps its mode (it may be /tmp, or shared
    on purpose); one that others can enter is a warning."""

    def __init__(self, directory: Union[str, os.PathLike], max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"prefix_cache_bytes must be positive, got {max_bytes}")
        self.dir = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self._warned: set = set()
        try:
            self.dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            mode = stat.S_IMODE(self.dir.stat().st_mode)
        except OSError as e:
            self._warn("create the folder", e)
        else:
            if mode & 0o077:
                log.warning("prefix cache %s: other users may read this folder (mode %o), and its files hold "
                            "conversations; chmod 700 it, or choose a private folder", self.dir, mode)

    def _warn(self, action: str, error: BaseException) -> None:
        """A cache is an optimisation: a folder that cannot be read or written (read-only, full, a path
        under a file) costs the reuse, never the generation. Each kind of failure is a warning once, then
        a debug record, so a broken cache does not flood the log on every turn."""
        kind = (action, getattr(error, "errno", None) or type(error).__name__)
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, "prefix cache %s: cannot %s (%s); going on without it", self.dir, action, error)

    def entries(self, key: Optional[str] = None) -> list[CacheEntry]:
        out = []
        try:
            for p in self.dir.glob(f"{key or '*'}-*{SUFFIX}"):
                parts = p.name[:-len(SUFFIX)].split("-")
                if len(parts) == 3 and parts[1].isdigit():
                    out.append(CacheEntry(p, int(parts[1]), parts[2]))
        except OSError as e:
            self._warn("list the folder", e)
        return out

    def lookup(self, key: str, tokens: Sequence[int], longer_than: int = 0) -> Optional[CacheEntry]:
        """The longest cached prefix of `tokens` for this key with more than `longer_than` tokens."""
        candidates = [e for e in self.entries(key) if longer_than < e.n_tokens <= len(tokens)]
        if not candidates:
            return None
        digests = _token_digests(tokens, {e.n_tokens for e in candidates})
        for e in sorted(candidates, key=lambda e: -e.n_tokens):
            if digests[e.n_tokens] == e.digest:
                _touch(e.path)
                return e
        return None

    def store(self, key: str, session: _core.Session) -> Optional[Path]:
        """Save the session's chunk-aligned prefix (if it has a whole chunk and fits the cap); returns
        the file, or None when nothing was stored (a failure to write is a logged warning, not an error).
        A model with linear-attention layers has its state only for everything held: it stores all of it."""
        ct = session.pager.config().chunk_tokens
        n_chunks = session.n_tokens // ct
        if n_chunks == 0:
            return None
        n = session.n_tokens if session.has_recurrent_state else n_chunks * ct
        if n_chunks * session.kv.chunk_bytes + 4 * n > self.max_bytes:
            log.info("prefix cache: a %d-token prefix would exceed prefix_cache_bytes=%d; not stored", n, self.max_bytes)
            return None
        digest = _token_digests(session.tokens[:n], {n})[n]
        path = self.dir / f"{key}-{n}-{digest}{SUFFIX}"
        try:
            if path.exists():
                _touch(path)
                return path
            session.save(path, prefix_chunks=None if session.has_recurrent_state else n_chunks)
            os.chmod(path, PRIVATE_FILE)   # the core writes it with the umask's mode
        except (OSError, SnapshotError) as e:
            self._warn("store a snapshot", e)
            return None
        self.evict(keep=path)
        return path

    def discard(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self._warn("delete a stale snapshot", e)

    def evict(self, keep: Optional[Path] = None) -> None:
        """Delete least recently used entries until the directory holds at most max_bytes."""
        now = time.time()
        try:
            stale = [t for t in self.dir.glob(f"*{SUFFIX}.tmp*") if now - _mtime(t) > STALE_TMP_SECONDS]
        except OSError as e:
            self._warn("list the folder", e)
            stale = []
        for tmp in stale:
            self.discard(tmp)
        sized = [(e.path, _mtime(e.path), _size(e.path)) for e in self.entries()]
        total = sum(s for _, _, s in sized)
        for path, _, size in sorted(sized, key=lambda x: x[1]):
            if total <= self.max_bytes:
                break
            if path != keep:
                self.discard(path)
                total -= size

    def total_bytes(self) -> int:
        return sum(_size(e.path) for e in self.entries())


def _touch(path: Path) -> None:
    """Mark a file used, and private (a file an older version stored was 0644)."""
    try:
        os.utime(path)
        os.chmod(path, PRIVATE_FILE)
    except OSError:
        pass   # evicted by another process meanwhile (the load reports the miss), a read-only folder, not ours


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
