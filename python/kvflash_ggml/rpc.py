"""ggml-rpc devices: where ggml-rpc-server is found, starting one on this host (tests, trying it out), and the
connections' timeout.

A Model runs on one with `Model(..., rpc=["host:port"])` (`--rpc host:port` on the command line); the endpoint
is checked in C++ before ggml sees it (cpp/model/rpc.cpp). A server that goes away later, or does not answer
within the timeout, is a ConnectionError naming it where the next result is read; that Model's weights and K/V
are lost with it (close it; load again and restore the session from its last snapshot). ggml-rpc-server has no
authentication: start it on 127.0.0.1 or a trusted network only."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from . import _core

SERVER_NAME = "ggml-rpc-server"


def find_rpc_server() -> Optional[str]:
    """$KVFLASH_RPC_SERVER, the one installed in the package (KVFLASH_RPC_SERVER=ON builds, the default of
    `pip install .`), or one in a build folder under the working directory (build/*/bin/ggml-rpc-server)."""
    candidates = [os.environ.get("KVFLASH_RPC_SERVER"), str(Path(__file__).resolve().parent / SERVER_NAME)]
    candidates += [str(p) for p in sorted(Path.cwd().glob(f"build/*/bin/{SERVER_NAME}"))]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def set_rpc_timeout(seconds: float) -> None:
    """Send/receive timeout of the RPC connections made from now on, in seconds (0: none; default 120). A server
    that makes no progress for that long counts as lost. Process-wide, as the connections are: the Models of a
    process share one per endpoint, made when the first of them loads. A step's compute is waited for within
    it, so keep it above the longest step (a long prompt's on a slow device)."""
    _core.set_rpc_timeout(seconds)


def rpc_timeout() -> float:
    """The timeout set_rpc_timeout sets (seconds; 0: none)."""
    return _core.rpc_timeout()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a server started next: rpc-server, kvflash serve, llama-server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_rpc_server(binary: str, *, host: str = "127.0.0.1", port: Optional[int] = None, threads: int = 0,
                     extra: Sequence[str] = (), timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Starts `binary` on host:port (a free port when None), waits until it answers ggml-rpc's handshake, and
    returns (process, "host:port"). The caller stops it (process.terminate())."""
    port = port or free_port(host)
    cmd = [binary, "-H", host, "-p", str(port), *(["-t", str(threads)] if threads else []), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    endpoint = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{SERVER_NAME} exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            _core.check_rpc_endpoint(endpoint, timeout_s=2.0)
            return proc, endpoint
        except ConnectionError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise
            time.sleep(0.1)
