"""Kit cases: the listener under adversarial connections, and dials bounded and ended by close.

For every backend that `listens` (its address names a host and port): a
peer is held to `HANDSHAKE_MAX_FRAME` before its handshake, at most
`max_pending` connections wait in their handshake and an idle or trickling
one is closed at its deadline, IPv6 hosts bind, and `close()` reaches a
connection still in its handshake. On the dialing side (#25 item 4): a peer
that trickles its welcome cannot hold `connect` past `connect_timeout`, and
the engine's `close()` ends a dial in progress.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from ..errors import ClosedError, TransferTimeout, TransportError
from ..wire import HANDSHAKE_MAX_FRAME, LENGTH
from .rig import WAIT, Backend, Trickler, need, until


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


def _dial(engine: object) -> socket.socket:
    addr = engine.address()
    return socket.create_connection((addr["host"], addr["port"]), timeout=10)


def test_pre_handshake_frame_over_the_cap_is_refused_at_once(backend: Backend) -> None:
    need(backend, "listens")
    with backend.create(connect_timeout=60.0) as eng:
        with _dial(eng) as sock:
            sock.sendall(LENGTH.pack(HANDSHAKE_MAX_FRAME + 1))
            # well inside the 60 s handshake timeout: the refusal is for the size, not idleness
            assert _eof_within(sock, 30.0)


def test_pending_connections_are_capped_and_idle_ones_time_out(backend: Backend) -> None:
    need(backend, "listens")
    with backend.create(connect_timeout=0.5, max_pending=4) as eng:
        socks = [_dial(eng) for _ in range(10)]
        try:
            closed = [s for s in socks if _eof_within(s, 30.0)]
            # every one is closed: 6 at accept, 4 after their 0.5 s handshake timeout
            assert len(closed) == 10
            assert eng.listener.refused >= 1
            assert until(lambda: eng.listener.pending == 0)
        finally:
            for s in socks:
                s.close()


def test_a_peer_trickling_its_handshake_is_closed_at_the_deadline(backend: Backend) -> None:
    # one byte per 0.2 s keeps a 0.5 s per-recv timeout from firing; the deadline must
    need(backend, "listens")
    with backend.create(connect_timeout=0.5) as eng:
        with _dial(eng) as sock:
            sock.sendall(LENGTH.pack(HANDSHAKE_MAX_FRAME))
            sock.settimeout(0.2)
            for _ in range(300):  # 60 s at most; the 0.5 s deadline ends it long before
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


def test_close_reaches_a_connection_still_waiting_for_its_hello(backend: Backend) -> None:
    # a 60 s handshake timeout: an EOF within 30 s is close's doing, not the timeout's
    need(backend, "listens")
    eng = backend.create(connect_timeout=60.0)
    try:
        with _dial(eng) as sock:
            sock.sendall(LENGTH.pack(10))  # part of a hello: the link is blocked reading the rest
            assert until(lambda: eng.listener.pending > 0), "the listener never accepted it"
            eng.close()
            sock.settimeout(30)
            assert sock.recv(1) == b""  # the engine hung up instead of waiting out the handshake
    finally:
        eng.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


def test_transfer_over_ipv6_loopback(backend: Backend) -> None:
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    need(backend, "listens")
    with backend.create(host="::1") as a, backend.create(host="::1") as b:
        assert a.address()["host"] == "::1"
        src = a.register(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        dst_t = torch.zeros(4096, dtype=torch.uint8)
        dst = b.register(dst_t)
        a.connect(b.address()).write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)
        assert torch.equal(dst_t, torch.arange(4096, dtype=torch.int64).to(torch.uint8))


def test_listener_binds_the_ipv6_wildcard(backend: Backend) -> None:
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    need(backend, "listens")
    with backend.create(host="::") as eng:
        assert eng.address()["port"] > 0
        with socket.create_connection(("::1", eng.address()["port"]), timeout=10) as sock:
            sock.sendall(LENGTH.pack(HANDSHAKE_MAX_FRAME + 1))
            assert _eof_within(sock, 30.0)


def test_a_peer_trickling_its_welcome_cannot_hold_a_dial_past_connect_timeout(backend: Backend) -> None:
    need(backend, "listens")
    with backend.create(connect_timeout=0.5) as eng:
        peer = Trickler(every=0.1)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="connect_timeout=0.5"):
                eng.connect(peer.address(eng.name))
            took = time.monotonic() - t0
            assert took < 0.5 + 2.0, f"the dial took {took:.1f} s against connect_timeout=0.5"
        finally:
            peer.close()


def test_close_ends_a_dial_in_progress(backend: Backend) -> None:
    need(backend, "listens")
    eng = backend.create(connect_timeout=60.0)
    peer = Trickler(every=0.2, silent=True)
    try:
        errors: list[BaseException] = []

        def dial() -> None:
            try:
                eng.connect(peer.address(eng.name))
            except BaseException as exc:
                errors.append(exc)

        dialer = threading.Thread(target=dial)
        dialer.start()
        assert peer.accepted.wait(WAIT)
        eng.close()
        dialer.join(5.0)
        assert not dialer.is_alive(), "close() left the dial thread blocked in recv"
        assert len(errors) == 1 and isinstance(errors[0], ClosedError), errors
    finally:
        eng.close()
        peer.close()


def test_listener_options_are_checked(backend: Backend) -> None:
    need(backend, "listens")
    with pytest.raises(TransportError, match="max_pending must be a positive int"):
        backend.create(max_pending=0)
