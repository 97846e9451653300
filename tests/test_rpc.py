"""ggml-rpc: SmolLM2 with its weights and pool on the one device of a ggml-rpc-server (its CPU backend) on
127.0.0.1, against the same runs on the local CPU; and the endpoint checks that keep ggml-rpc from aborting the
process (it GGML_ABORTs on a failed connect or handshake)."""
import socket
import time

import numpy as np
import pytest

from kvflash_ggml import _core
from kvflash_ggml.rpc import find_rpc_server, free_port, start_rpc_server
from kvflash_ggml.testing.prose import prose

pytestmark = pytest.mark.skipif(not _core.rpc_available(), reason="this build has no ggml RPC backend (KVFLASH_RPC=OFF)")

# The server runs the same ggml CPU code on the same graph as the local CPU backend. Matmuls can still be
# split across a different number of threads (the server's own), and the scheduler moves the step inputs,
# not the math; a bound far below any token-changing difference, far above float rounding seen (0.0).
TOL = 1e-3


@pytest.fixture(scope="module")
def rpc_endpoint():
    binary = find_rpc_server()
    if binary is None:
        pytest.skip("ggml-rpc-server was not built (pip install . builds it: KVFLASH_RPC_SERVER=ON; or "
                    "$KVFLASH_RPC_SERVER, or build/*/bin/ggml-rpc-server)")
    proc, endpoint = start_rpc_server(binary, threads=2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def rpc_model(smollm2_path, rpc_endpoint):
    return _core.Model(smollm2_path, backend="rpc", rpc=[rpc_endpoint], n_threads=2)


def prompt_tokens(vocab, n, seed):
    tokens = vocab.tokenize(prose(n // 3 + 40, seed=seed), add_special=True)[:n]
    assert len(tokens) == n
    return np.array(tokens, np.int32)


def test_model_on_rpc_device(rpc_model, rpc_endpoint):
    assert rpc_model.on_rpc and rpc_model.on_gpu
    assert rpc_endpoint in rpc_model.backend_name   # "RPC0[127.0.0.1:port]"


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_prompt_logits_equal_local_cpu(smollm2, smollm2_vocab, rpc_model, attention):
    tokens = prompt_tokens(smollm2_vocab, 200, seed=11)
    cfg = _core.SessionConfig(max_tokens=256, pool_tokens=0, attention=attention)
    local = _core.Session(smollm2, cfg).forward(tokens, 0, all_logits=True)
    remote = _core.Session(rpc_model, cfg).forward(tokens, 0, all_logits=True)
    diff = float(np.abs(local - remote).max())
    print(f"rpc vs cpu, 200-token prompt, attention={attention}: max |logit diff| {diff}")
    assert diff <= TOL
    assert (local.argmax(axis=1) == remote.argmax(axis=1)).all()


@pytest.mark.slow
def test_pooled_session_pages_through_rpc_device(smollm2, smollm2_vocab, rpc_model):
    tokens = prompt_tokens(smollm2_vocab, 900, seed=12)
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
