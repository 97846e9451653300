"""Issue 39 item 2: a snapshot is written over, and read from, regular files only. Saving wrote a temporary file
and renamed it over the path, which turned an existing FIFO or device node into a regular file (as root this
replaced a system device node) and replaced a symbolic link; loading a FIFO waited for a writer forever, and a
device was refused with a bare errno. Tiny random-weight model, CPU, one thread."""
from __future__ import annotations

import errno
import os
import stat
import threading

import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml import _core


@pytest.fixture(scope="module")
def session(tiny_gguf):
    model = _core.Model(tiny_gguf(), backend="cpu", n_threads=1)
    s = _core.Session(model, _core.SessionConfig(max_tokens=1024, pool_tokens=448))
    s.forward(np.arange(1, 100, dtype=np.int32), 0)
    return s


def leftovers(folder, keep: set) -> list[str]:
    return sorted(set(os.listdir(folder)) - keep)


def test_save_refuses_a_fifo_and_leaves_it_a_fifo(session, tmp_path):
    # regression: the rename turned the FIFO into a regular file holding the snapshot
    path = tmp_path / "snap.kvf"
    os.mkfifo(path)
    with pytest.raises(FileExistsError, match=r"not a regular file \(a FIFO\)") as e:
        session.save(path)
    assert e.value.filename == str(path)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert leftovers(tmp_path, {"snap.kvf"}) == []   # no temporary file left behind


def test_save_refuses_a_symbolic_link_and_leaves_its_target(session, tmp_path):
    # regression: the rename replaced the link by a regular file (a link to a regular file included)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "snap.kvf"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match=r"a symbolic link.*give the path of the file itself"):
        session.save(link)
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "keep me"
    dangling = tmp_path / "dangling.kvf"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="a symbolic link"):
        session.save(dangling)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_save_refuses_a_device_node(session, tmp_path):
    # regression: as root, the rename replaced a character device (the trial lost a system device node this way)
    if os.geteuid() != 0:
        pytest.skip("creating a device node (os.mknod) needs root")
    path = tmp_path / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))   # the numbers of /dev/null
    except PermissionError as e:
        pytest.skip(f"this container refuses mknod even to root: {e}")
    with pytest.raises(FileExistsError, match=r"not a regular file \(a character device\)"):
        session.save(path)
    assert stat.S_ISCHR(os.lstat(path).st_mode)
    assert leftovers(tmp_path, {"null"}) == []


def test_save_replaces_a_regular_file_and_never_follows_a_planted_temporary_link(session, tmp_path):
    # A regular file is still replaced atomically. The temporary name beside it is created afresh (O_EXCL): a link
    # planted under that name is not written through (fopen "wb" followed it and truncated its target).
    path = tmp_path / "snap.kvf"
    path.write_bytes(b"old")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    planted = tmp_path / f"snap.kvf.tmp{os.getpid()}"
    planted.symlink_to(victim)
    session.save(path)
    assert victim.read_text() == "keep me" and planted.is_symlink()
    assert _core.snapshot_file_info(path)["n_tokens"] == session.n_tokens
    assert leftovers(tmp_path, {"snap.kvf", "victim.txt", planted.name}) == []


def test_load_names_what_is_not_a_regular_file(session, tmp_path):
    # regression: a device was refused with errno's bare "Invalid argument"; the reason is now the message
    for path, kind in (("/dev/null", "a character device"),):
        with pytest.raises(OSError, match=rf"not a regular file \({kind}\)") as e:
            session.load(path)
        assert e.value.errno == errno.EINVAL and e.value.filename == path
    with pytest.raises(IsADirectoryError, match="is a directory"):
        session.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        session.load(tmp_path / "missing.kvf")


def test_load_of_a_fifo_is_refused_at_once(session, tmp_path):
    # regression: opening a FIFO for reading waited for a writer, forever
    path = tmp_path / "snap.kvf"
    os.mkfifo(path)
    held = session.tokens.tolist()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            session.load(path)
        except BaseException as e:   # handed to the test's thread
            errors.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=20)   # measured: a few ms; the old code never returned
    assert not worker.is_alive(), "load_state blocked on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], OSError), errors
    assert "not a regular file (a FIFO)" in str(errors[0])
    assert session.tokens.tolist() == held


def test_model_save_state_and_load_state_say_the_same(tiny_gguf, tmp_path):
    # the user-facing calls reach the same checks
    path = tmp_path / "snap.kvf"
    os.mkfifo(path)
    with kvf.Model(tiny_gguf(), n_ctx=256, backend="cpu", n_threads=1) as m:
        m.create_completion("hello there", max_tokens=2, temperature=0.0)
        with pytest.raises(FileExistsError, match=r"a FIFO"):
            m.save_state(path)
        with pytest.raises(OSError, match=r"not a regular file \(a character device\)"):
            m.load_state("/dev/null")
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
