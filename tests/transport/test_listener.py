"""Every socket listener under adversarial connections: bounded memory, bounded pre-handshake state.

Issue #9: a peer that announces a large frame and stalls must cost what it
sent, not what it announced; before its handshake a peer is held to
`HANDSHAKE_MAX_FRAME`; a listener holds at most `max_pending` connections in
their handshake and closes idle ones after `connect_timeout`; and listeners
bind IPv6 hosts.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from pdxfer.transport import wire
from pdxfer.transport.listener import family_for

from pdxfer import transport

SOCKET_BACKENDS = [b for b in ("tcp", "nixl") if b in transport.available()]
FUZZ = pathlib.Path(__file__).with_name("fuzz_listeners.py")
RSS_BOUND_MIB = 50


def _eof_within(sock: socket.socket, timeout: float) -> bool:
    """True when the listener hung up on `sock` (EOF or reset) within `timeout` s."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_fuzzing_the_listener_leaves_rss_within_bound(backend: str) -> None:
    proc = subprocess.run([sys.executable, str(FUZZ), backend], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["case"] for r in rows} >= {"announce", "garbage", "storm"}
    for row in rows:
        assert row["rss_growth_mib"] < RSS_BOUND_MIB, row
    storm = next(r for r in rows if r["case"] == "storm")
    assert storm["refused"] >= storm["connections"] // 2, storm


@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_pre_handshake_frame_over_the_cap_is_refused_at_once(backend: str) -> None:
    with transport.create(backend, connect_timeout=60.0) as eng:
        addr = eng.address()
        with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
            sock.sendall(wire.LENGTH.pack(wire.HANDSHAKE_MAX_FRAME + 1))
            # well inside the 60 s handshake timeout: the refusal is for the size, not idleness
            assert _eof_within(sock, 30.0)


@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_pending_connections_are_capped_and_idle_ones_time_out(backend: str) -> None:
    with transport.create(backend, connect_timeout=1.0, max_pending=4) as eng:
        addr = eng.address()
        socks = [socket.create_connection((addr["host"], addr["port"]), timeout=10) for _ in range(10)]
        try:
            closed = [s for s in socks if _eof_within(s, 30.0)]
            # every one is closed: 6 at accept, 4 after their 1 s handshake timeout
            assert len(closed) == 10
            assert eng._listener.refused >= 1 and eng._listener.pending == 0
        finally:
            for s in socks:
                s.close()


@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_a_peer_trickling_its_handshake_is_closed_at_the_deadline(backend: str) -> None:
    # one byte per 0.3 s keeps the per-recv timeout from firing; the deadline must
    with transport.create(backend, connect_timeout=1.0) as eng:
        addr = eng.address()
        with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
            sock.sendall(wire.LENGTH.pack(wire.HANDSHAKE_MAX_FRAME))
            sock.settimeout(0.3)
            for _ in range(200):  # 60 s at most; the 1 s deadline ends it long before
                try:
                    sock.sendall(b"\x00")
                    if not sock.recv(1):
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            else:
                pytest.fail("a trickling pre-handshake peer was never closed")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


def test_listener_family_follows_the_host() -> None:
    assert family_for("::1") == socket.AF_INET6 and family_for("::") == socket.AF_INET6
    assert family_for("127.0.0.1") == socket.AF_INET and family_for("") == socket.AF_INET


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_transfer_over_ipv6_loopback(backend: str) -> None:
    with transport.create(backend, host="::1") as a, transport.create(backend, host="::1") as b:
        assert a.address()["host"] == "::1"
        src = a.register(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        dst_t = torch.zeros(4096, dtype=torch.uint8)
        dst = b.register(dst_t)
        a.connect(b.address()).write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(30)
        assert torch.equal(dst_t, torch.arange(4096, dtype=torch.int64).to(torch.uint8))


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("backend", SOCKET_BACKENDS)
def test_listener_binds_the_ipv6_wildcard(backend: str) -> None:
    with transport.create(backend, host="::") as eng:
        assert eng._listener._sock.family == socket.AF_INET6
