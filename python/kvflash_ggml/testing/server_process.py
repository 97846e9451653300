"""A server in a subprocess on a free port (ours, `kvflash serve`, or llama-server), for the tests and for
`kvflash bench serve`: started, waited for (/health answers 200), and stopped with SIGTERM as a service
manager stops it, which runs the server's own shutdown."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx

from ..rpc import free_port


class ServerProcess:
    def __init__(self, argv: Sequence[str], *, port: int, log: Path, timeout: float = 120.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not come up in {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    @classmethod
    def kvflash(cls, *flags: str, log: Path, timeout: float = 120.0) -> "ServerProcess":
        """`kvflash serve FLAGS` (this Python) on a free port."""
        port = free_port()
        return cls([sys.executable, "-m", "kvflash_ggml", "serve", "--port", str(port), *flags], port=port, log=log,
                   timeout=timeout)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def rss_bytes(self) -> int:
        """The process's resident memory (0 once it has exited)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self, timeout: float = 120.0) -> bool:
        """SIGTERM; whether the server shut down cleanly (uvicorn re-raises the signal after its graceful
        shutdown, so the exit status is -SIGTERM then; llama-server exits 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode in (0, -signal.SIGTERM)
