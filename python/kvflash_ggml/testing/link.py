"""An emulated network link and simulated hosts on one machine (issue 40 item 4): the cost of a model split across
hosts (ggml-rpc-servers on other machines) measured before anyone builds such a deployment.

Hosts: network namespaces, each joined to this one (the client's) by its own veth pair, with an address from
198.18.0.0/15 (the range set aside for network benchmarks); needs root and `ip` (netns_unavailable() says why
not). Without them the "hosts" are 127.0.0.1, and only the link below separates them.

The link: a TCP forwarder in its own process between the client and a server, which delays each direction's bytes
by the one-way latency and paces them to the rate. It stands in for `tc qdisc ... netem`: this VM's kernel has no
netem qdisc ("Specified qdisc kind is unknown"; tbf and htb exist, so the rate alone could come from the kernel),
and the GPU machines have neither `ip` nor `tc`. So both latency and rate are the forwarder's, the same emulation
everywhere. Its model of a link: bytes enter when the forwarder reads them, leave one after another at the rate
(a FIFO wire, rate counted on TCP payload bytes, headers not), and arrive the latency later. Its own cost (a read,
a thread hand-off and a write per message: tens of microseconds, measured by link_rtt()) comes on top; a
profile's figures should be read with the RTT measured through it. cut() is a cable pulled: every connection
is reset (both ends see EOF or a reset at once) and new connections are refused.

The forwarder runs in a child process (python link.py serve ...), never in the client's: a client call that holds
the GIL while it waits for its server (some do) would otherwise stall the very link it waits on."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    name: str
    latency_s: float   # one way
    rate_bps: float    # bits per second of TCP payload; 0 = unpaced

    def describe(self) -> str:
        rate = f"{self.rate_bps / 1e9:g} Gbit/s" if self.rate_bps else "unpaced"
        return f"{self.name}: {rate}, {self.latency_s * 1e3:g} ms one way"


# Issue 40 item 4's links: a datacenter's (25 Gbit/s, 0.1-0.5 ms: the middle) and a home network's.
PROFILES = {"dc": LinkProfile("dc", 0.25e-3, 25e9), "home": LinkProfile("home", 1e-3, 1e9)}

CHUNK = 64 * 1024   # bytes read at a time: at 1 Gbit/s 0.5 ms of wire, fine enough to pace


# ---- the forwarder (the child process) --------------------------------------------------------------------

class _Traffic:
    """What a link carried: bytes each way, and exchanges: the times a client spoke after its server had (or first),
    each a round trip the client may have waited for (ggml-rpc's commands with a reply are)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_up = self.bytes_down = self.exchanges = 0

    def arrived(self, last_up: list, up: bool) -> None:
        """Bytes read from one end of a connection (last_up: that connection's last speaker, [None] at first)."""
        with self.lock:
            if up and last_up[0] is not True:
                self.exchanges += 1
            last_up[0] = up

    def delivered(self, up: bool, n: int) -> None:
        with self.lock:
            if up:
                self.bytes_up += n
            else:
                self.bytes_down += n


class _Direction:
    """One direction of one connection: a reader thread stamps each read with the time it arrives at the far end
    (after the wire is free, its bytes at the rate, plus the latency); a writer thread sends it then. The queue
    is bounded (back-pressure onto the sender, as a link's buffers are)."""

    def __init__(self, src: socket.socket, dst: socket.socket, up: bool, forwarder: "_Forwarder",
                 last_up: list) -> None:
        self.src, self.dst, self.up, self.last_up = src, dst, up, last_up
        self.latency_s, self.rate_bps, self.oversleep_s = forwarder.latency_s, forwarder.rate_bps, forwarder.oversleep_s
        self.traffic = forwarder.traffic
        self.max_queued = max(4 << 20, int(2 * self.rate_bps / 8 * self.latency_s))
        self.queue: deque = deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.eof = False
        self.wire_free_at = 0.0
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._read, self._write)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK)
                if not data:
                    break
                now = time.monotonic()
                self.traffic.arrived(self.last_up, self.up)
                serialize = len(data) * 8 / self.rate_bps if self.rate_bps else 0.0
                self.wire_free_at = max(self.wire_free_at, now) + serialize
                with self.cond:
                    while self.queued > self.max_queued:
                        self.cond.wait()
                    self.queue.append((self.wire_free_at + self.latency_s, data))
                    self.queued += len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.eof:
                        self.cond.wait()
                    if not self.queue:
                        break   # the sender closed and everything before it arrived
                    due, data = self.queue[0]
                _sleep_until(due, self.oversleep_s)
                self.dst.sendall(data)
                self.traffic.delivered(self.up, len(data))
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
            self.dst.shutdown(socket.SHUT_WR)   # pass the sender's EOF on
        except OSError:
            pass


def _sleep_until(t: float, oversleep_s: float) -> None:
    """Sleep until monotonic time t: a long sleep wakes later than a short one on these VMs (5 ms: ~0.3 ms late),
    so all but the last 0.5 ms first, then the rest less the measured late wake-up of a short sleep."""
    if t - time.monotonic() > 1e-3:
        time.sleep(t - time.monotonic() - 5e-4)
    delay = t - time.monotonic() - oversleep_s
    if delay > 0:
        time.sleep(delay)


def _nodelay(s: socket.socket) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no Nagle: ggml-rpc's small requests go at once
    return s


def _reset(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), waking a thread blocked in recv on it first."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    s.close()


class _Forwarder:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], latency_s: float, rate_bps: float,
                 oversleep_s: float) -> None:
        self.upstream, self.latency_s, self.rate_bps, self.oversleep_s = upstream, latency_s, rate_bps, oversleep_s
        self.listener = socket.create_server(listen)
        self.listener.settimeout(0.1)
        self.sockets: list[socket.socket] = []
        self.traffic = _Traffic()
        self.n_connections = 0
        self.lock = threading.Lock()
        self.cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                server = _nodelay(socket.create_connection(self.upstream, timeout=10))
                server.settimeout(None)
            except OSError:
                _reset(client)   # the far host does not answer: the client sees a reset, as without a link
                continue
            with self.lock:
                if self.cut:
                    _reset(client), _reset(server)
                    return
                self.sockets += [_nodelay(client), server]
                self.n_connections += 1
            last_up = [None]
            directions = (_Direction(client, server, True, self, last_up),
                          _Direction(server, client, False, self, last_up))
            threading.Thread(target=self._close_when_done, args=(directions, client, server), daemon=True).start()

    def _close_when_done(self, directions, client: socket.socket, server: socket.socket) -> None:
        for d in directions:
            for t in d.threads:
                t.join()
        with self.lock:
            if client in self.sockets:   # not reset by a cut meanwhile
                self.sockets.remove(client), self.sockets.remove(server)
                client.close(), server.close()

    def do_cut(self) -> None:
        with self.lock:
            self.cut = True
            try:   # shutdown stops listening at once; close alone waits for the accept thread's poll to return
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()   # new connections: refused
            for s in self.sockets:
                _reset(s)
            self.sockets.clear()

    def stats(self) -> dict:
        t = self.traffic
        return {"bytes_up": t.bytes_up, "bytes_down": t.bytes_down, "exchanges": t.exchanges,
                "connections": self.n_connections,
                "cut": self.cut, "oversleep_s": self.oversleep_s}


def _fine_timers() -> None:
    """Timer slack 1 ns for this thread and the threads it starts (Linux's default, 50 us, and the wake-up after it
    made every delayed write ~0.1-0.2 ms late: most of a datacenter link's 0.25 ms)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)   # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


def _oversleep() -> float:
    """How late this machine's threads wake from a short sleep (median of a few): subtracted from each delay."""
    late = []
    for _ in range(21):
        t0 = time.monotonic()
        time.sleep(2e-4)
        late.append(time.monotonic() - t0 - 2e-4)
    return max(0.0, sorted(late)[len(late) // 2])


def _serve(argv: Sequence[str]) -> None:
    """The child: `serve LISTEN_HOST UPSTREAM_HOST UPSTREAM_PORT LATENCY_S RATE_BPS`; prints its port, then
    answers one JSON line per command read on stdin (stats, cut); ends when stdin closes."""
    listen_host, up_host, up_port, latency_s, rate_bps = argv
    _fine_timers()
    fwd = _Forwarder((listen_host, 0), (up_host, int(up_port)), float(latency_s), float(rate_bps), _oversleep())
    print(json.dumps({"port": fwd.listener.getsockname()[1]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cut":
            fwd.do_cut()
        print(json.dumps(fwd.stats()), flush=True)
    fwd.do_cut()


# ---- the parent's handle --------------------------------------------------------------------------------------

class Link:
    """An emulated link from this host to a server at `upstream` ("host:port"): connect to `endpoint` instead.
    Stop it with close() (or use it as a context manager)."""

    def __init__(self, upstream: str, profile: LinkProfile, listen_host: str = "127.0.0.1") -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.profile = upstream, profile
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", listen_host, host, port,
                                      repr(profile.latency_s), repr(profile.rate_bps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the link emulator to {upstream} did not start (exit {self.proc.wait()})")
        self.endpoint = f"{listen_host}:{json.loads(line)['port']}"

    def _command(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the link emulator to {self.upstream} is gone (exit {self.proc.poll()})")
        return json.loads(line)

    def stats(self) -> dict:
        """Since the link started: bytes carried each way (bytes_up: to the server), exchanges (round trips: the
        times a client spoke after its server had), connections made; cut, and the late wake-up subtracted."""
        return self._command("stats")

    def cut(self) -> None:
        """A cable pulled: every connection reset at both ends, new ones refused. Returns once done."""
        self._command("cut")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def link_rtt(endpoint: str, n: int = 50, size: int = 64) -> float:
    """The median round trip of `size`-byte messages to an echo server at `endpoint` (seconds)."""
    host, port = endpoint.rsplit(":", 1)
    times = []
    with _nodelay(socket.create_connection((host, int(port)), timeout=10)) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x" * size)
            got = 0
            while got < size:
                chunk = s.recv(size - got)
                if not chunk:
                    raise ConnectionError(f"{endpoint} closed the connection")
                got += len(chunk)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---- simulated hosts --------------------------------------------------------------------------------------

def netns_unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class Host:
    """A simulated host: a network namespace joined to this one by a veth pair (address: `address`), or this
    host's loopback when `netns` is None. run_argv() prefixes a command so that it runs there."""

    def __init__(self, name: str, netns: Optional[str], address: str) -> None:
        self.name, self.netns, self.address = name, netns, address
        self._next_port = 50052   # ggml-rpc-server's usual port, then the next ones (a fresh namespace has none taken)

    def take_port(self) -> int:
        """A port nothing listens on there: the next of its own (a namespace), or a free one (127.0.0.1)."""
        from ..rpc import free_port
        if not self.netns:
            return free_port()
        self._next_port += 1
        return self._next_port - 1

    def run_argv(self, argv: Sequence[str]) -> list[str]:
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + list(argv)


class Hosts:
    """n simulated hosts (namespaces where netns_unavailable() is None and use_netns, else 127.0.0.1); close()
    removes them (the namespaces, their veth pairs; the processes started in them are the caller's to stop)."""

    def __init__(self, n: int, use_netns: bool = True) -> None:
        self.reason = netns_unavailable() if use_netns else "namespaces not asked for"
        self.hosts: list[Host] = []
        try:
            for i in range(n):
                self.hosts.append(self._make(i) if self.reason is None else Host(f"host{i}", None, "127.0.0.1"))
        except BaseException:
            self.close()
            raise

    def _make(self, i: int) -> Host:
        # Unique per process and host: names (veth names have at most 15 characters) and a /30 of 198.18.0.0/15.
        tag = f"kvf{os.getpid()}h{i}"
        base = 198 << 24 | 18 << 16 | ((os.getpid() * 8 + i) % (1 << 15)) << 2
        near, far = (".".join(str(base + k >> s & 255) for s in (24, 16, 8, 0)) for k in (1, 2))
        _ip("netns", "add", tag)
        host = Host(f"host{i}", tag, far)
        self.hosts.append(host)   # removed by close() even if what follows fails
        _ip("link", "add", f"{tag}n", "type", "veth", "peer", "name", f"{tag}f")
        _ip("link", "set", f"{tag}f", "netns", tag)
        _ip("addr", "add", f"{near}/30", "dev", f"{tag}n")
        _ip("-n", tag, "addr", "add", f"{far}/30", "dev", f"{tag}f")
        for args in (["link", "set", f"{tag}n", "up"], ["-n", tag, "link", "set", f"{tag}f", "up"],
                     ["-n", tag, "link", "set", "lo", "up"]):
            _ip(*args)
        self.hosts.pop()
        return host

    def close(self) -> None:
        for host in self.hosts:
            if host.netns:
                # This end first: deleting the namespace deletes the pair too, but the kernel frees a namespace's
                # devices later, on its own thread (a loaded machine still listed this end after `netns delete`).
                subprocess.run(["ip", "link", "delete", f"{host.netns}n"], capture_output=True)
                subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True)
        self.hosts = []

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_rpc_server_on(host: Host, binary: str, *, threads: int = 1,
                        timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """ggml-rpc-server on `host` (its address, a port of host.take_port()), waited for until it answers ggml-rpc's
    handshake from here; returns (process, "address:port"). The caller stops it."""
    port = host.take_port()
    argv = host.run_argv([binary, "-H", host.address, "-p", str(port), "-t", str(threads)])
    log = tempfile.TemporaryFile("w+")   # not a pipe: it logs every connection, and a full pipe would stall it
    with log:   # the child keeps its own copy open
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        return proc, _wait_for_handshake(proc, host, port, log, timeout_s)


def _wait_for_handshake(proc: subprocess.Popen, host: Host, port: int, log, timeout_s: float) -> str:
    from .. import _core
    endpoint = f"{host.address}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"ggml-rpc-server on {host.name} exited ({proc.returncode}): {log.read()[-2000:]}")
        try:
            _core.check_rpc_endpoint(endpoint, timeout_s=2.0)
            return endpoint
        except ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(sys.argv[2:])
