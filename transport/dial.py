"""Dialing a peer: connect and handshake under one deadline, and aborted by the engine's close.

Every backend that reaches its peers through a socket (tcp's data streams,
nixl's and verbs' control links) opens it the same way: connect, send a
hello frame, read the peer's welcome, check it names the engine we meant.
Two guarantees, written once here (#25 item 4):

* one deadline bounds the whole dial — `connect_timeout` from the first
  SYN to the last byte of the welcome. Each read waits only for what is left
  of it (`Protocol.recv(..., deadline=)`), so a peer that accepts, then
  trickles its welcome a byte at a time, cannot hold the dial past it;
* the engine's `close()` ends every dial it started: the socket is
  registered in the engine's `Dials` for as long as the dial runs, and
  `Dials.abort` shuts it down under the blocked thread, which then fails
  with `ClosedError`. So an owner's close (a PD engine's) never leaves a
  dial thread blocked in `recv`. (A `connect()` still in its SYN cannot be
  interrupted that way on Linux; it is bounded by the deadline instead.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import ClosedError, PeerLostError, ProtocolError, TransferTimeout, TransportError
from .wire import ErrorMessage, Protocol


def tune(sock: socket.socket) -> None:
    """Options every link socket gets: no Nagle delay on small frames, keepalive for dead hosts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Dials:
    """The sockets an engine is dialing on right now; `abort()` (at close) shuts them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def dialing(self, sock: socket.socket) -> Iterator[None]:
        """Track `sock` for the block's duration; `ClosedError` if the engine is closing."""
        with self._lock:
            if self._closed:
                raise ClosedError("the engine is closing: no new dial")
            self._socks.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._socks.discard(sock)

    def abort(self) -> None:
        """Refuse new dials and wake every dial in progress (its reads fail at once). Idempotent."""
        with self._lock:
            self._closed = True
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def dial(dials: Dials, host: str, port: int, protocol: Protocol, hello: Any, *,
         timeout: float, peer: str, what: str, deadline: float | None = None) -> tuple[socket.socket, Any]:
    """`(socket, welcome)`: connected, `hello` sent, the peer's first frame read — within `timeout`.

    `deadline` (monotonic), when given, ends the dial earlier: a link of
    several sockets dials them all under one `connect_timeout`.
    `what` names the peer in errors ("tcp engine X at host:port"). The
    welcome must carry `engine == peer`; a peer that refuses (`ErrorMessage`)
    is a `ProtocolError`, an address now answered by another engine a
    `PeerLostError` (the peer restarted). The socket comes back blocking
    (no timeout), tuned, the caller's to close.
    """
    end = time.monotonic() + timeout
    deadline = end if deadline is None else min(deadline, end)
    try:
        sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 1e-3))
    except OSError as exc:
        raise PeerLostError(f"cannot connect to {what}: {exc}") from exc
    try:
        with dials.dialing(sock):
            tune(sock)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            protocol.send(sock, hello)
            reply = protocol.recv(sock, deadline=deadline)
        if isinstance(reply, ErrorMessage):
            raise ProtocolError(f"{what} refused the handshake: {reply.reason}")
        if getattr(reply, "engine", None) != peer:
            if not hasattr(reply, "engine"):
                raise ProtocolError(f"{what} answered hello with {type(reply).TYPE}")
            raise PeerLostError(
                f"{host}:{port} is engine {reply.engine}, not {peer}; "
                "the address is stale (the peer restarted?) — fetch a fresh one")
        sock.settimeout(None)
    except BaseException as exc:
        sock.close()
        if dials.closed and isinstance(exc, (TransportError, OSError)):
            raise ClosedError(f"dial to {what} ended: the engine closed") from exc
        if isinstance(exc, TransferTimeout):
            raise TransferTimeout(
                f"{what} did not complete its handshake within connect_timeout={timeout} s "
                f"({exc}); it is stalled or not a pdxfer engine") from exc
        raise
    return sock, reply
