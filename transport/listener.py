"""The listening socket of a socket backend, and what an unauthenticated peer may cost us.

The tcp and nixl backends each accept connections from anyone who can reach
their port; until a connection has completed its backend's handshake nothing
vouches for it. This module owns that stretch, once for both:

* binding: the address family follows the host (`::1`, `::`, a v6 name → IPv6;
  anything else → IPv4), so a listener binds wherever the control plane can;
* at most `max_pending` connections per listener may sit before their
  handshake; one past that is closed at accept, so a connection storm costs a
  bounded number of threads and sockets (each pre-handshake read is also
  capped at `wire.HANDSHAKE_MAX_FRAME`);
* out of descriptors or memory (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`),
  an accept fails while the connection stays queued, and a loop that
  retries at once spins a core; `AcceptBackoff` holds accepting off for
  `ACCEPT_BACKOFF` (100 ms, trio's accept loop's rule) and logs once per
  episode (the PD prefill's selector-driven accept uses it too);
* a pre-handshake connection gets `handshake_timeout` seconds in all: the
  socket's own timeout catches one that sends nothing, and the accept loop
  shuts down one that trickles bytes past its deadline (the accept waits at
  most until the earliest deadline, and only while some connection is
  pending — an idle listener blocks in `accept` and never wakes).

A backend hands each accepted socket to its `on_accept(sock, peer, slot)`,
reads the peer's first frame with `read_hello` (capped, typed), and calls
`slot.admitted()` when the handshake is done (or the connection ends);
`Slot.admitted` is idempotent, so `finally: slot.admitted()` is always right.
Every backend that listens does it through `EngineBase.listen`: tcp, nixl
and verbs alike.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import ProtocolError, TransportError
from .wire import HANDSHAKE_MAX_FRAME, Protocol

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 64
# Accept failures that mean "out of a resource", not "this connection is bad": the connection
# stays queued, so retrying at once fails again at once (trio's accept loop, the same list).
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF = 0.1  # seconds without accepting after one of those (trio sleeps 100 ms too)


class AcceptBackoff:
    """When to accept again after an accept failed for want of a resource; logs once per episode.

    `failed(exc)` is True (and starts or extends an episode) for an
    `OUT_OF_RESOURCES` error: the caller stops accepting for `ACCEPT_BACKOFF`
    s and keeps serving everything else. `accepted()` ends the episode (one
    line saying how many accepts failed in it).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0  # in the current episode
        self.episodes = 0

    def failed(self, exc: OSError) -> bool:
        """Whether `exc` means "out of resources": back off for `ACCEPT_BACKOFF` s, then retry."""
        if exc.errno not in OUT_OF_RESOURCES:
            return False
        if not self.failures:
            self.episodes += 1
            log.warning("%s: accept failed (%s); accepting again every %.0f ms until it "
                        "succeeds, serving the rest meanwhile", self.what, exc, ACCEPT_BACKOFF * 1e3)
        self.failures += 1
        return True

    def accepted(self) -> None:
        """An accept succeeded: the episode (if any) is over."""
        if self.failures:
            log.warning("%s: accepting again after %d failed attempts", self.what, self.failures)
            self.failures = 0


def family_for(host: str) -> socket.AddressFamily:
    """The address family a listener on `host` needs (IPv6 for `::`, `::1`, v6-only names)."""
    if ":" in host:
        return socket.AF_INET6
    if host in ("", "0.0.0.0"):
        return socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET  # create_server reports the unresolvable name
    families = {info[0] for info in infos}
    return socket.AF_INET if socket.AF_INET in families else socket.AF_INET6


class Slot:
    """One connection's claim on its listener's pre-handshake budget."""

    __slots__ = ("_listener", "_sock", "deadline", "done")

    def __init__(self, listener: Listener, sock: socket.socket, deadline: float) -> None:
        self._listener, self._sock, self.deadline, self.done = listener, sock, deadline, False

    def admitted(self) -> None:
        """The handshake finished (or the connection ended): free the slot. Idempotent."""
        self._listener.release(self)

    def expire(self) -> None:
        try:  # wakes the thread blocked reading the handshake; it sees EOF
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Listener:
    """A bound, listening socket plus its accept thread and pre-handshake accounting."""

    def __init__(
        self,
        backend: str,
        host: str,
        port: int,
        on_accept: Callable[[socket.socket, str, Slot], None],
        *,
        handshake_timeout: float,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise TransportError(f"max_pending must be a positive int, got {max_pending!r}")
        self.backend = backend
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self.refused = 0  # connections closed at accept because the budget was spent
        self._on_accept = on_accept
        self._lock = threading.Lock()
        self._pending: set[Slot] = set()
        self._closed = False
        self._stop = threading.Event()  # set by close: ends a backoff wait
        self._backoff = AcceptBackoff(f"{backend} listener")
        try:
            self._sock = socket.create_server(
                (host, port), family=family_for(host), backlog=128,
                dualstack_ipv6=False,
            )
        except OSError as exc:
            raise TransportError(f"{backend} engine cannot listen on {host}:{port}: {exc}") from exc
        bound = self._sock.getsockname()
        self.host = socket.gethostname() if host in ("", "0.0.0.0", "::") else bound[0]
        self.port = bound[1]
        self._thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"{backend}-accept {self.port}"
        )
        self._thread.start()

    @property
    def pending(self) -> int:
        """Connections accepted and not yet through their handshake."""
        with self._lock:
            return len(self._pending)

    def release(self, slot: Slot) -> None:
        """Free `slot` (its connection finished its handshake or ended). Idempotent."""
        with self._lock:
            if slot.done:
                return
            slot.done = True
            self._pending.discard(slot)

    def _next_wait(self) -> float | None:
        """Seconds until the earliest pending deadline (expiring the overdue), None if none."""
        now = time.monotonic()
        with self._lock:
            overdue = [s for s in self._pending if s.deadline <= now]
            live = [s.deadline for s in self._pending if s.deadline > now]
        for slot in overdue:
            log.info("%s listener %d: handshake not done in %.1f s; closing it",
                     self.backend, self.port, self.handshake_timeout)
            slot.admitted()  # first: a peer that sees the EOF finds the slot free
            slot.expire()
        return min(live) - now if live else None

    def _accept_loop(self) -> None:
        while True:
            try:
                self._sock.settimeout(self._next_wait())
                sock, addr = self._sock.accept()
            except TimeoutError:
                continue  # a pending deadline passed: _next_wait expires it
            except OSError as exc:
                if self._closed:
                    return
                if self._backoff.failed(exc):  # out of fds: the connection stays queued
                    self._stop.wait(ACCEPT_BACKOFF)
                else:
                    log.warning("%s listener %d: accept failed: %s", self.backend, self.port, exc)
                continue
            self._backoff.accepted()
            sock.settimeout(self.handshake_timeout)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                full = len(self._pending) >= self.max_pending
                if full:
                    self.refused += 1
                else:
                    slot = Slot(self, sock, time.monotonic() + self.handshake_timeout)
                    self._pending.add(slot)
            if full:
                if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th...: a storm logs ~log2(n) lines
                    log.warning("%s listener %d: %d connections still in their handshake; closed "
                                "%d in all, the last from %s", self.backend, self.port,
                                self.max_pending, self.refused, addr[0])
                sock.close()
                continue
            try:
                self._on_accept(sock, f"{addr[0]}:{addr[1]}", slot)
            except Exception:  # our bug: never let it stop the listener
                log.exception("%s listener %d: accepting %s failed", self.backend, self.port, addr)
                slot.admitted()
                sock.close()

    def close(self, timeout: float) -> None:
        """Stop accepting and join the accept thread (at most `timeout` s). Idempotent."""
        with self._lock:
            self._closed = True
        self._stop.set()  # ends a backoff wait at once
        try:  # wakes the blocked accept() on Linux
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def read_hello(sock: socket.socket, protocol: Protocol, hello: type) -> Any:
    """An accepted connection's first frame: at most `HANDSHAKE_MAX_FRAME` bytes, of type `hello`.

    The listener set the socket's handshake timeout; this caps the size, so
    an unauthenticated peer is held to a few KiB whatever it announces.
    """
    msg = protocol.recv(sock, HANDSHAKE_MAX_FRAME)
    if not isinstance(msg, hello):
        raise ProtocolError(f"expected hello as the first frame, got {type(msg).TYPE}")
    return msg
