"""ggml-rpc: SmolLM2 with its weights and pool on the one device of a ggml-rpc-server (its CPU backend) on
127.0.0.1, against the same runs on the local CPU; the endpoint checks that keep ggml-rpc from aborting the
process (it GGML_ABORTs on a failed connect or handshake); and a server lost mid-stream (killed, or silent past
the timeout), which our patch of ggml-rpc turns from an abort into a ConnectionError."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import kvflash_ggml
from kvflash_ggml import _core
from kvflash_ggml.rpc import free_port, start_rpc_server
from kvflash_ggml.testing.prose import prose_tokens

from device_check import prompt_logits_both

pytestmark = pytest.mark.skipif(not _core.rpc_available(), reason="this build has no ggml RPC backend (KVFLASH_RPC=OFF)")

# The server runs the same ggml CPU code on the same graph as the local CPU backend. Matmuls can still be
# split across a different number of threads (the server's own), and the scheduler moves the step inputs,
# not the math; a bound far below any token-changing difference, far above float rounding seen (0.0).
TOL = 1e-3


@pytest.fixture(scope="module")
def rpc_endpoint(rpc_binary):
    proc, endpoint = start_rpc_server(rpc_binary, threads=2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def rpc_model(smollm2_path, rpc_endpoint):
    return _core.Model(smollm2_path, backend="rpc", rpc=[rpc_endpoint], n_threads=2)


def test_model_on_rpc_device(rpc_model, rpc_endpoint):
    assert rpc_model.on_rpc and rpc_model.on_gpu
    assert rpc_endpoint in rpc_model.backend_name   # "RPC0[127.0.0.1:port]"


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_prompt_logits_equal_local_cpu(smollm2, smollm2_vocab, rpc_model, attention):
    local, remote, diff = prompt_logits_both(smollm2, rpc_model, smollm2_vocab, 11, attention, "rpc")
    assert diff <= TOL
    assert (local.argmax(axis=1) == remote.argmax(axis=1)).all()


@pytest.mark.slow
def test_pooled_session_pages_through_rpc_device(smollm2, smollm2_vocab, rpc_model):
    tokens = prose_tokens(smollm2_vocab, 900, seed=12)
    cfg = _core.SessionConfig(max_tokens=1024, pool_tokens=448, attention="matmul")
    out = []
    for model in (smollm2, rpc_model):
        s = _core.Session(model, cfg)
        s.forward(tokens, 0)            # the pool fills: the oldest chunks page out to the host store
        n_chunks = (len(tokens) + _core.CHUNK_TOKENS - 1) // _core.CHUNK_TOKENS
        scores = np.linspace(1.0, 0.0, n_chunks).astype(np.float32)   # the early chunks back in
        s.reselect(scores)
        stats = s.pager.stats()
        assert stats.page_outs > 0 and stats.page_ins > 0, stats
        out.append((s.forward(np.array([int(tokens[-1])], np.int32), s.n_tokens), stats.page_outs, stats.page_ins))
    (local, *local_pages), (remote, *remote_pages) = out
    diff = float(np.abs(local - remote).max())
    print(f"rpc vs cpu, pooled (448 of 901, page-outs/ins {remote_pages}): max |logit diff| {diff}")
    assert local_pages == remote_pages
    assert diff <= TOL
    assert int(local.argmax()) == int(remote.argmax())


def test_unreachable_endpoint_raises_quickly(smollm2_path):
    port = free_port()   # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        _core.Model(smollm2_path, backend="rpc", rpc=[f"127.0.0.1:{port}"])
    assert time.monotonic() - t0 < 6.0


def test_silent_listener_times_out(smollm2_path):
    # Accepts the connection (the kernel's backlog) but never answers the handshake: the timeout, not a hang.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        endpoint = f"127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="handshake"):
            _core.check_rpc_endpoint(endpoint, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("bad", ["127.0.0.1", "127.0.0.1:", ":50052", "127.0.0.1:port", "127.0.0.1:0",
                                 "127.0.0.1:70000", "[::1]:50052", "host name:1", ""])
def test_malformed_endpoint_is_value_error(smollm2_path, bad):
    with pytest.raises(ValueError, match="RPC endpoint|needs an endpoint"):
        _core.Model(smollm2_path, backend="rpc", rpc=[bad] if bad else [])


def test_rpc_options_are_checked(smollm2_path):
    with pytest.raises(ConnectionError, match="127.0.0.1:1 "):   # several servers: each is checked (test_split.py)
        _core.Model(smollm2_path, backend="rpc", rpc=["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(ValueError, match="backend 'cpu'"):
        _core.Model(smollm2_path, backend="cpu", rpc=["127.0.0.1:1"])


def test_cli_flag_parses_endpoints():
    import argparse
    from kvflash_ggml.commands.flags import add_model_flags, parse_rpc
    assert parse_rpc("127.0.0.1:50052, 10.0.0.2:50053") == ["127.0.0.1:50052", "10.0.0.2:50053"]
    ap = argparse.ArgumentParser()
    add_model_flags(ap)
    assert ap.parse_args(["--rpc", "127.0.0.1:50052"]).rpc == ["127.0.0.1:50052"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--rpc", "127.0.0.1"])


def test_rpc_timeout_setting():
    before = _core.rpc_timeout()
    assert before == 120.0   # the patch's default; no test leaves another value behind
    try:
        _core.set_rpc_timeout(7.5)
        assert _core.rpc_timeout() == 7.5
        _core.set_rpc_timeout(0)   # none
        assert _core.rpc_timeout() == 0.0
        for bad in (-1.0, 0.0001, 2e6, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="rpc timeout"):
                _core.set_rpc_timeout(bad)
    finally:
        _core.set_rpc_timeout(before)


# ---- a server lost mid-stream ------------------------------------------------------------------------------
# Each scenario runs in a child process: unpatched, ggml-rpc aborts the whole process (an abort must not take
# pytest down), and a hang must fail the test, not stall it. The parent starts the servers (so it can always
# kill them); the child loads SmolLM2 on one, loses it, and prints its findings as one JSON line after each
# stage, so a hang or a crash still shows how far it got.

LOST_PRELUDE = """
import gc, json, logging, os, signal, sys, threading, time
from kvflash_ggml import Model, _core
logging.basicConfig(level=logging.WARNING)   # ggml's log lines (kvflash_ggml.ggml) to stderr
model_path, endpoint, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
found = {}
def report(**kw):
    found.update(kw)
    print(json.dumps(found), flush=True)
def load(ep, pool_tokens=None):
    return Model(model_path, rpc=[ep], n_ctx=2048, pool_tokens=pool_tokens, n_threads=2)
def second_call(llm):   # the logits path (sampled), where the stream took the greedy one
    t0 = time.monotonic()
    try:
        llm.create_completion("Again", max_tokens=2, temperature=0.8, seed=1)
        report(second=None)
    except ConnectionError as e:
        report(second=str(e), second_s=time.monotonic() - t0)
def close(llm):
    t0 = time.monotonic()
    llm.close()
    gc.collect()
    report(close_s=time.monotonic() - t0)
PROMPT = "The capital of France is"
"""

# Killed (SIGKILL) mid-stream: between two decode steps of a full cache, or by a thread 0.3 s into a prompt
# larger than the pool (most likely during its layer-major exact prefill; else during the decode after it).
# Then the recovery the error message asks for: a new Model on a new server, the snapshot saved before the
# loss, and the same continuation as the lost Model produced from that snapshot.
KILLED = LOST_PRELUDE + """
from kvflash_ggml.testing.prose import prose
snap, endpoint2, when = sys.argv[4], sys.argv[5], sys.argv[6]
pool_tokens = 448 if when == "thread" else None
llm = load(endpoint, pool_tokens)
llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
llm.save_state(snap)
llm.load_state(snap)
report(reference=llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"])
killed = []
def kill():
    os.kill(pid, signal.SIGKILL)
    killed.append(time.monotonic())
prompt = prose(60, seed=3) if when == "thread" else "Once upon a time"
if when == "thread":
    threading.Timer(0.3, kill).start()
n = 0
try:
    for _ in llm.create_completion(prompt, max_tokens=200, temperature=0.0, stream=True):
        n += 1
        if when == "between_steps" and n == 3:
            kill()
    report(error=None, n_tokens=n)
except ConnectionError as e:
    report(error=str(e), n_tokens=n, raise_s=time.monotonic() - killed[0])
second_call(llm)
close(llm)
del llm
llm = load(endpoint2, pool_tokens)
llm.load_state(snap)
report(restored=llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"])
llm.close()
report(done=True)
"""

# Killed between two layers of a layer-major exact prefill (its between() hook runs after each layer): the
# check after each layer's steps stops the prompt at the next layer, instead of running the rest over a dead
# connection. Through _core, so each error is known to come from the call that raised it. Then everything
# else the lost Model is asked: a step, a snapshot, a new Session on it, a new Model on the endpoint it holds.
PREFILL = LOST_PRELUDE + """
import numpy as np
from kvflash_ggml.testing.prose import prose
snap = sys.argv[4]
model = _core.Model(model_path, backend="rpc", rpc=[endpoint], n_threads=2)
config = _core.SessionConfig(max_tokens=2048, pool_tokens=448)
session = _core.Session(model, config)
tokens = np.array(_core.Vocab(model_path).tokenize(prose(40, seed=5), add_special=True)[:1000], np.int32)
session.forward(tokens[:64], 0)
layers_done = []
def between():
    layers_done.append(1)
    if len(layers_done) == 3:
        os.kill(pid, signal.SIGKILL)
try:
    session.prefill_exact(tokens[64:], 64, between=between)
    report(error=None)
except ConnectionError as e:
    report(error=str(e))
report(n_layer=model.hparams.n_layer, layers_done=len(layers_done), n_tokens=session.n_tokens)
def raises(name, call):
    t0 = time.monotonic()
    try:
        call()
        report(**{name: None})
    except ConnectionError as e:
        report(**{name: str(e), name + "_s": time.monotonic() - t0})
raises("second", lambda: session.forward(tokens[64:65], 64))
report(n_after_second=session.n_tokens, pager_ok=session.pager.check_invariants() is None)
raises("save", lambda: session.save(snap))
report(snapshot_written=os.path.exists(snap))
raises("new_session", lambda: _core.Session(model, config))
raises("new_model", lambda: _core.Model(model_path, backend="rpc", rpc=[endpoint], n_threads=2))
t0 = time.monotonic()
del session, model
gc.collect()
report(close_s=time.monotonic() - t0, done=True)
"""

# A split (two servers, then the local CPU, which computes the logits): the middle server killed between decode
# steps. The output read is local and fine; the check over every backend of the step's scheduler names the lost
# one, and the Model's other server is not blamed.
SPLIT = LOST_PRELUDE + """
endpoint_first = sys.argv[4]
llm = Model(model_path, devices=[f"rpc:{endpoint_first}", f"rpc:{endpoint}", "cpu"], tensor_split=[1, 1, 1],
            n_ctx=1024, pool_tokens=None, n_threads=2)
n = 0
try:
    for _ in llm.create_completion("Once upon a time", max_tokens=200, temperature=0.0, stream=True):
        n += 1
        if n == 3:
            os.kill(pid, signal.SIGKILL)
    report(error=None, n_tokens=n)
except ConnectionError as e:
    report(error=str(e), n_tokens=n)
second_call(llm)
close(llm)
report(done=True)
"""

# Killed while idle, then closed: the first command to meet the dead connection is a buffer free, sent while
# Python frees the Session (the GIL held) and logged on ggml-rpc's own thread: a regression test for the
# deadlock that was (that thread waited for the GIL, the freeing thread for it).
IDLE_THEN_CLOSED = LOST_PRELUDE + """
llm = load(endpoint)
llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)
os.kill(pid, signal.SIGKILL)
time.sleep(0.5)   # gone: its sockets closed
close(llm)
report(done=True)
"""

# Stopped (SIGSTOP): the connection stands but nothing answers; the timeout (2 s here) makes it lost.
SILENT = LOST_PRELUDE + """
_core.set_rpc_timeout(2.0)   # before the connection is made: it takes the timeout then
llm = load(endpoint)
llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)
os.kill(pid, signal.SIGSTOP)
t0 = time.monotonic()
try:
    llm.create_completion(PROMPT + " a city", max_tokens=4, temperature=0.0)
    report(error=None)
except ConnectionError as e:
    report(error=str(e), raise_s=time.monotonic() - t0)
second_call(llm)
close(llm)
report(done=True)
"""


def run_lost_scenario(script, args, timeout_s=240):
    """Runs `script` in a child Python with `args`; returns its last report. Fails on a hang or a crash."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(kvflash_ggml.__file__)), os.environ.get("PYTHONPATH", "")]),
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))   # see rpc_server_process
    try:
        proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the scenario hung for {timeout_s} s; its last report: {out.strip().splitlines()[-1:]}")
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    last = json.loads(reports[-1]) if reports else {}
    assert proc.returncode == 0, (f"the child process died (exit {proc.returncode}; -6 is an abort); last report "
                                  f"{last}; stderr:\n{proc.stderr[-3000:]}")
    assert last.get("done"), last
    return last, proc.stderr


@pytest.fixture
def rpc_server_process(rpc_binary, monkeypatch):
    # Client and server on one 2-core host, each with OpenMP threads that spin while they wait for work: the
    # lost-server scenarios' decode steps ran ~100x slower (11 tokens: 26 s, against 0.17 s with passive waits).
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "passive"))
    procs = []

    def start():
        proc, endpoint = start_rpc_server(rpc_binary, threads=2)
        procs.append(proc)
        return proc, endpoint
    yield start
    for proc in procs:
        proc.kill()   # SIGKILL: also ends a stopped one
        proc.wait(timeout=10)


@pytest.mark.parametrize("when", ["between_steps", "thread"])
def test_killed_server_is_a_connection_error(smollm2_path, rpc_server_process, tmp_path, when):
    proc, endpoint = rpc_server_process()
    _, endpoint2 = rpc_server_process()   # the recovery's
    found, stderr = run_lost_scenario(KILLED, [smollm2_path, endpoint, proc.pid, tmp_path / "s.kvf", endpoint2, when])
    print(f"killed {when}: {found['n_tokens']} tokens streamed, ConnectionError {found['raise_s']:.2f} s after the "
          f"kill, second call {found['second_s'] * 1e3:.1f} ms, close {found['close_s'] * 1e3:.1f} ms")
    assert found["error"] is not None, "the stream ended without noticing the dead server"
    assert f"ggml-rpc server at {endpoint} went away" in found["error"]
    assert "load the model again and restore the session from its last snapshot" in found["error"]
    # A dead peer closes the connection: seen at once (the next reply read), not after the 120 s timeout.
    assert found["raise_s"] < 10.0
    assert found["second"] == found["error"] and found["second_s"] < 1.0   # the same error, without waiting
    assert found["close_s"] < 5.0
    assert f"lost the connection to {endpoint}" in stderr   # the patch's one log line, naming the endpoint
    assert found["restored"] == found["reference"]


def test_silent_server_times_out(smollm2_path, rpc_server_process):
    proc, endpoint = rpc_server_process()
    found, _ = run_lost_scenario(SILENT, [smollm2_path, endpoint, proc.pid])
    print(f"silent server: ConnectionError after {found['raise_s']:.2f} s (timeout 2 s), second call "
          f"{found['second_s'] * 1e3:.1f} ms, close {found['close_s'] * 1e3:.1f} ms")
    assert found["error"] is not None
    assert f"ggml-rpc server at {endpoint} went away (or did not answer within 2 s)" in found["error"]
    # the timeout, not an earlier failure: nothing else ends a wait on a stopped peer
    assert 1.9 <= found["raise_s"] < 15.0
    assert found["second"] == found["error"] and found["second_s"] < 1.0
    assert found["close_s"] < 5.0


def test_server_killed_while_idle_then_closed(smollm2_path, rpc_server_process):
    proc, endpoint = rpc_server_process()
    found, stderr = run_lost_scenario(IDLE_THEN_CLOSED, [smollm2_path, endpoint, proc.pid], timeout_s=60)
    print(f"killed while idle: close {found['close_s'] * 1e3:.1f} ms")
    assert found["close_s"] < 5.0
    assert f"lost the connection to {endpoint}" in stderr


def test_server_killed_during_exact_prefill(smollm2_path, rpc_server_process, tmp_path):
    proc, endpoint = rpc_server_process()
    found, _ = run_lost_scenario(PREFILL, [smollm2_path, endpoint, proc.pid, tmp_path / "s.kvf"], timeout_s=120)
    print(f"killed after layer 3 of {found['n_layer']}: ConnectionError after layer {found['layers_done'] + 1}; then "
          + ", ".join(f"{k} {found[k + '_s'] * 1e3:.1f} ms" for k in ("second", "save", "new_session", "new_model"))
          + f", close {found['close_s'] * 1e3:.1f} ms")
    assert found["error"] is not None and f"ggml-rpc server at {endpoint} went away" in found["error"]
    assert found["layers_done"] == 3   # the next layer's check raised: no layer after it ran
    assert found["n_tokens"] == 64     # the failed prompt was forgotten, as after any exception
    assert found["n_after_second"] == 64 and found["pager_ok"]   # the failed step was unplaced
    for later in ("second", "save", "new_session"):   # the same error, without waiting
        assert found[later] == found["error"] and found[later + "_s"] < 1.0, later
    assert not found["snapshot_written"]   # a lost device's K/V read as zeros: no snapshot of them
    assert f"{endpoint} was lost and is still held by a Model" in found["new_model"]
    assert found["new_model_s"] < 1.0
    assert found["close_s"] < 5.0


def test_killed_server_of_a_split_is_named(smollm2_path, rpc_server_process):
    _, endpoint_first = rpc_server_process()
    proc, endpoint = rpc_server_process()
    found, _ = run_lost_scenario(SPLIT, [smollm2_path, endpoint, proc.pid, endpoint_first], timeout_s=120)
    print(f"split, middle server killed: ConnectionError after {found['n_tokens']} tokens, second call "
          f"{found['second_s'] * 1e3:.1f} ms, close {found['close_s'] * 1e3:.1f} ms")
    assert found["error"] is not None and f"ggml-rpc server at {endpoint} went away" in found["error"]
    assert endpoint_first not in found["error"]
    assert found["n_tokens"] == 3   # the step after the kill raised
    assert found["second"] == found["error"] and found["second_s"] < 1.0
    assert found["close_s"] < 5.0
