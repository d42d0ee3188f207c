"""Fuzz one socket backend's listener from inside its own process and report its RSS growth.

Run as a script (one backend per process, so the figure is that listener's
alone): `python tests/transport/fuzz_listeners.py tcp` prints one JSON line
`{"backend", "case", "connections", "rss_growth_mib", "refused"}` per case.
`test_listener.py` runs it and holds every case to +50 MiB; docs/reliability.md
records the figures.

Cases (each one the issue #9 adversary's move):
  announce  — connections that send only a length prefix announcing the
              protocol's largest frame, before any handshake, then stall;
  handshaken — (tcp) connections that complete the handshake, then announce
              a frame just under the 1 MiB limit, send 1 byte of it and stall;
  garbage   — connections that send random bytes and stall;
  storm     — more idle connections than the listener admits pre-handshake.

Synchronisation: the script wraps `wire.recv_exact` to count body reads of
more than `HANDSHAKE_MAX_FRAME` bytes (the reads the old code sized up front)
and waits for every stalled connection to reach one before it reads RSS.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

import numpy as np
from pdxfer.transport import wire

from pdxfer import transport

MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _BodyReads:
    """Counts body reads larger than the handshake cap (what announcing costs us)."""

    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()
        self._orig = wire.recv_exact
        wire.recv_exact = self._recv_exact  # Protocol.recv looks the name up per call

    def _recv_exact(self, sock: socket.socket, nbytes: int, *args: object) -> bytes:
        if nbytes > wire.HANDSHAKE_MAX_FRAME:
            with self.cond:
                self.count += 1
                self.cond.notify_all()
        return self._orig(sock, nbytes, *args)

    def wait(self, n: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, timeout)


def _connect(addr: dict) -> socket.socket:
    return socket.create_connection((addr["host"], addr["port"]), timeout=10)


def _settled(socks: list[socket.socket], timeout: float) -> None:
    """Wait until the listener answered or hung up on each refused socket (EOF or a frame)."""
    for s in socks:
        s.settimeout(timeout)
        try:
            s.recv(1 << 16)
        except OSError:
            pass


def _decided(socks: list[socket.socket], counter: _BodyReads, timeout: float) -> None:
    """Return once every socket was answered or hung up on, or reached a large body read (bounded)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    before, open_ = counter.count, list(socks)
    while open_ and counter.count - before < len(open_) and time.monotonic() < deadline:
        ready, _, _ = select.select(open_, [], [], 0.05)
        for s in ready:  # the listener answered it (a refusal, EOF or a reset): decided
            open_.remove(s)


def run(backend: str) -> list[dict]:
    engine = transport.create(backend)
    largest = 16 << 20  # at least every protocol's max_frame: each listener must refuse it unread
    counter = _BodyReads()
    addr = engine.address()
    rng = np.random.default_rng(9)
    out = []
    listener = engine.listener
    held: list[socket.socket] = []

    def report(case: str, n: int, base: int) -> None:
        out.append({"backend": backend, "case": case, "connections": n,
                    "rss_growth_mib": round((rss() - base) / MIB, 1),
                    "refused": listener.refused})

    # announce: 40 length prefixes of the largest frame, no handshake
    base = rss()
    socks = [_connect(addr) for _ in range(40)]
    for s in socks:
        s.sendall(wire.LENGTH.pack(largest))
    # Each connection's fate, whichever comes: a body read (the old code's, sized as announced)
    # or the listener answering (the cap's refusal). Waiting on the count alone sat out the
    # whole 5 s on a listener that refuses them all.
    _decided(socks, counter, 5.0)
    report("announce", len(socks), base)
    _settled(socks, 10.0)
    held += socks

    if backend == "tcp":  # nixl admits a link by building a NIXL agent: not a cheap fuzz
        from pdxfer.transport.tcp.wire import PROTOCOL, Hello, Welcome
        base = rss()
        before = counter.count
        socks = []
        for k in range(100):
            s = _connect(addr)
            s.sendall(PROTOCOL.pack(Hello(engine=f"fuzz-{k}", link=f"fuzz-{k}", stream=0, streams=1)))
            assert isinstance(PROTOCOL.recv(s), Welcome)
            s.sendall(wire.LENGTH.pack(PROTOCOL.max_frame - 16) + b"\x00")
            socks.append(s)
        ok = counter.wait(before + len(socks), 10.0)
        assert ok, "handshaken connections never reached their body read"
        report("handshaken", len(socks), base)
        held += socks

    base = rss()
    socks = [_connect(addr) for _ in range(40)]
    for s in socks:
        s.sendall(rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes())
    _settled(socks, 10.0)
    report("garbage", len(socks), base)
    held += socks

    base = rss()
    socks = [_connect(addr) for _ in range(listener.max_pending * 3)]
    _settled(socks[listener.max_pending:], 0.5)  # closed ones answer EOF at once
    report("storm", len(socks), base)
    held += socks

    for s in held:
        s.close()
    engine.close()
    return out


if __name__ == "__main__":
    for row in run(sys.argv[1]):
        print(json.dumps(row), flush=True)
