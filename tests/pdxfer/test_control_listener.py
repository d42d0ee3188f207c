"""The prefill's control listener bounds what strangers can make it hold (#9 items 1 and 3).

Before a peer's Hello is accepted its frames are capped at
`session.PRE_HANDSHAKE_MAX_FRAME`, at most `session.MAX_PENDING` such links
are held, and each gets `connect_timeout` to say Hello, even one that keeps
trickling bytes (and so is never "silent"). Only the control plane is
exercised, so one backend is enough.
"""

from __future__ import annotations

import select
import socket
import struct
import time

import pytest
from pdxfer_testkit import build_pools, config

from pdxfer import PrefillEngine
from pdxfer.session import MAX_FRAME, MAX_PENDING, PRE_HANDSHAKE_MAX_FRAME, parse_address

WAIT = 20.0  # ceiling on any one wait; each is ended by the event it waits for


@pytest.fixture
def prefill():
    engine = PrefillEngine(build_pools(16, 4, seed=1), config("loopback", timeout=2.0))
    try:
        yield engine
    finally:
        engine.close()


def _dial(engine: PrefillEngine) -> socket.socket:
    sock = socket.create_connection(parse_address(engine.bootstrap_address), timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def _hung_up(sock: socket.socket) -> bool:
    """Read until the listener closes the connection (True) or WAIT passes (False)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def test_a_frame_over_the_pre_handshake_cap_is_refused_at_once(prefill) -> None:
    # Well under MAX_FRAME, so only the pre-handshake cap can refuse it.
    length = 4 * PRE_HANDSHAKE_MAX_FRAME
    assert length < MAX_FRAME
    with _dial(prefill) as sock:
        sock.sendall(struct.pack(">I", length) + b"\0" * 16)
        start = time.monotonic()
        assert _hung_up(sock), "the listener held a stranger's oversized frame"
        # at once: the frame's prefix is refused, not the handshake deadline (2 s here)
        assert time.monotonic() - start < 1.5


def test_pending_connections_past_the_cap_are_closed_at_accept() -> None:
    # Long waits here, so only the cap can close a connection during the test.
    cfg = config("loopback", timeout=60.0, connect_timeout=60.0)
    extra = 4
    with PrefillEngine(build_pools(16, 4, seed=1), cfg) as engine:
        socks = [_dial(engine) for _ in range(MAX_PENDING + extra)]
        try:
            open_, closed = set(socks), []
            deadline = time.monotonic() + WAIT
            while len(closed) < extra and time.monotonic() < deadline:
                ready, _, _ = select.select(list(open_), [], [], deadline - time.monotonic())
                for s in ready:
                    open_.discard(s)
                    closed.append(s)
            assert len(closed) == extra, f"{len(closed)} of the {extra} surplus connections closed"
            for s in closed:
                assert _hung_up(s)  # readable because the listener hung up, not for data
            # ... and not one more: the first MAX_PENDING are still held
            ready, _, _ = select.select(list(open_), [], [], 0.5)
            assert ready == [] and len(open_) == MAX_PENDING
        finally:
            for s in socks:
                s.close()


def test_a_peer_trickling_its_hello_is_closed_at_the_connect_deadline(prefill) -> None:
    deadline = prefill.config.connect_wait
    with _dial(prefill) as sock:
        sock.sendall(struct.pack(">I", 1000))  # a plausible Hello length, then a byte at a time
        sock.settimeout(0.2)
        start = time.monotonic()
        hung_up = False
        while time.monotonic() - start < WAIT and not hung_up:
            try:
                sock.sendall(b"\x80")
                hung_up = sock.recv(1) == b""
            except TimeoutError:
                continue  # pacing the trickle: the listener said nothing yet
            except (ConnectionResetError, BrokenPipeError):
                hung_up = True
        elapsed = time.monotonic() - start
    assert hung_up, f"a trickling stranger was held for {WAIT} s"
    # never silent (a byte every 0.2 s), so only the Hello deadline can have closed it
    assert elapsed >= deadline * 0.9
