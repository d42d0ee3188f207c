"""Control links: framed, non-blocking sockets between a prefill and a decode engine.

A `ControlConn` is one TCP connection carrying `protocol.CONTROL` frames. It lives on
its engine's progress thread (`progress.Progress`): reads arrive as selector
events and are cut into frames incrementally; writes go out immediately when
the socket takes them and are buffered (with a write-interest registration)
when it does not, so no control message ever blocks the loop.

A link records when it last heard from and spoke to its peer; the owning
engine's tick turns those into heartbeats (`Ping`) and into "silent for
longer than the timeout" — the stall detector that catches a peer whose
process is alive but stopped (SIGSTOP, a hung host) where EOF never comes.

Output is bounded per link (`MAX_BACKLOG`): a peer that stops reading
cannot make us buffer without limit. Past the bound the link stops reading
that peer's input — what it asks of us is what grows our output — and
records since when it is stuck; the owning engine closes it, with the reason
logged, once it has been stuck for the liveness timeout (`Engine._watch`).
Messages the engine itself must send (an Abort, a Done) are still queued
past the bound, so no request is left without its answer while the peer
drains.

A link that goes wrong in any way — EOF, reset, a malformed or oversized
frame, a handshake that does not finish — is closed exactly once, with a
reason, and the owner's `on_close` decides what that means for its requests.
The wire's `ErrorMessage` is sent before hanging up on a peer that spoke
nonsense, so the other side's log says why.

Input is bounded before the handshake too. A link a listener accepted is
`handshaken=False` until its owner accepts the peer's Hello: until then its
frames are capped at `PRE_HANDSHAKE_MAX_FRAME` (not `MAX_FRAME`), so a stranger
sending length prefixes makes us hold at most that much per connection, and
the owner caps how many such links it holds (`MAX_PENDING`) and how long each
may take (`Engine._watch`). A link we dialed is handshaken from the start: we
chose that peer.

Also here: parsing a bootstrap address (`host:port`), since both sides agree
on its spelling.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
from collections.abc import Callable
from typing import Any

from pdxfer.transport.errors import ProtocolError, TransportError
from pdxfer.transport.wire import LENGTH, ErrorMessage

from .errors import RequestError
from .progress import Progress
from .protocol import CONTROL, MAX_FRAME
from .resolver import resolve_blocking

log = logging.getLogger("pdxfer")

_READ_CHUNK = 256 * 1024
# Bytes read per readiness event before yielding to other sockets: one busy
# peer must not starve the rest of the loop.
_READ_BUDGET = 4 << 20
# Bytes queued for a peer past which we stop reading it: a few of the largest
# frames, so a normal burst (hundreds of Expects) never trips it.
MAX_BACKLOG = 4 * MAX_FRAME
# Largest frame from a peer that has not yet said Hello. A Hello carries the
# decode's pool descriptions (a few KiB for the example hybrid model: about
# 2 KiB per pool of a handful of fields); 64 KiB leaves room for models with
# dozens of fields while keeping what a stranger can make us hold small.
PRE_HANDSHAKE_MAX_FRAME = 64 * 1024
# Connections a listener holds that have not completed their Hello; one past
# this is closed at accept, so a connection storm costs sockets, not memory.
MAX_PENDING = 64


def parse_address(addr: object) -> tuple[str, int]:
    """`(host, port)` from `"host:port"` (or `"[v6]:port"`), or `RequestError` saying why not."""
    if not isinstance(addr, str) or ":" not in addr:
        raise RequestError(f"prefill address must be 'host:port', got {addr!r}")
    host, _, port_text = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    # isascii first: str.isdigit() accepts '²', which int() then refuses with a raw ValueError
    if (not host or not (port_text.isascii() and port_text.isdigit())
            or not 0 < int(port_text) < 65536):
        raise RequestError(f"prefill address must be 'host:port' with a port 1..65535, got {addr!r}")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int, who: str) -> socket.socket:
    """A non-blocking listening socket on `host`'s first address (its family from `getaddrinfo`).

    Resolves on the caller's thread (an engine's constructor), so a name
    that resolves to IPv6 only listens on IPv6; `""` means every interface.
    """
    try:
        family, sockaddr = resolve_blocking(host or None, port, socket.AI_PASSIVE)[0]
        sock = socket.create_server(sockaddr, backlog=128, family=family)
    except OSError as exc:
        raise TransportError(
            f"{who} cannot listen on {format_address(host, port)}: {exc}; "
            "pick another EngineConfig.port (0 picks a free one)"
        ) from exc
    sock.setblocking(False)
    return sock


class ControlConn:
    """One control connection, owned by a progress thread.

    `send` only queues and writes: it never handles input (a drained backlog
    resumes reading at the loop's next turn) and never runs the owner's
    `on_close` inline, so it is safe to call from inside a handler.
    """

    def __init__(
        self,
        sock: socket.socket,
        progress: Progress,
        label: str,
        on_message: Callable[[ControlConn, Any], None],
        on_close: Callable[[ControlConn, str], None],
        *,
        connecting: bool = False,
        accepted: bool = False,
    ) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.sock = sock
        self.label = label
        self.owner: Any = None  # the session this link serves, set by the engine
        self._progress = progress
        self._on_message = on_message
        self._on_close = on_close
        self._in = bytearray()
        self._out = bytearray()
        self.connecting = connecting
        # A link a listener accepted is a stranger until its owner accepts the
        # Hello (see the module docstring); one we dialed is not.
        self.handshaken = not accepted
        self.closed = False
        self.close_reason: str | None = None
        now = self._progress.clock.now()
        self.opened = now
        self.last_rx = now
        self.last_tx = now
        self.stuck_since: float | None = None  # output past MAX_BACKLOG since then
        self._events = 0
        self._update_interest()

    # -- opening ----------------------------------------------------------
    @classmethod
    def dial(cls, family: int, sockaddr: Any, progress: Progress, label: str,
             on_message: Callable[[ControlConn, Any], None],
             on_close: Callable[[ControlConn, str], None]) -> ControlConn:
        """Start a non-blocking connect to a resolved address; frames sent meanwhile go out once it completes.

        `(family, sockaddr)` come from `resolver`: a host name is never
        looked up here, since this runs on the progress thread.
        """
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            err = sock.connect_ex(sockaddr)
        except OSError:  # an address this host cannot use: nothing to keep open
            sock.close()
            raise
        link = cls(sock, progress, label, on_message, on_close, connecting=True)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            link.close(f"cannot connect to {label}: {errno.errorcode.get(err, err)}")
        return link

    # -- sending ----------------------------------------------------------
    def send(self, msg: Any) -> None:
        """Queue one message; written now if the socket takes it. A closed link drops it."""
        if self.closed:
            return
        self._out += CONTROL.pack(msg)
        self.last_tx = self._progress.clock.now()
        if not self.connecting:
            self._flush()

    def _flush(self) -> None:
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(f"control link to {self.label} failed while sending: {exc}")
                return
            del self._out[:n]
        self._note_backlog()
        self._update_interest()

    @property
    def backlog(self) -> int:
        """Bytes queued for the peer and not yet taken by the socket."""
        return len(self._out)

    def _note_backlog(self) -> None:
        if len(self._out) > MAX_BACKLOG:
            if self.stuck_since is None:
                self.stuck_since = self._progress.clock.now()
                log.warning("pdxfer: %s is not reading (%d B queued); its input is paused",
                            self.label, len(self._out))
        elif self.stuck_since is not None and len(self._out) <= MAX_BACKLOG // 2:
            self.stuck_since = None  # hysteresis: resume once half the bound drained
            # Input held back while stuck is handled at the loop's next turn, never here:
            # this may run inside a caller's `send`, whose caller may hold a lock the
            # handlers take, and message N+1 must not run in the middle of message N's
            # effects (#29.1). Parsing is only ever started by the loop.
            self._progress.call(self._resume)

    def _resume(self) -> None:
        """Progress loop: handle the frames read before the link got stuck."""
        if not self.closed:
            self._parse()

    # -- receiving --------------------------------------------------------
    def _on_event(self, mask: int) -> None:
        if self.closed:
            return
        if self.connecting:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.close(f"cannot connect to {self.label}: {errno.errorcode.get(err, err)}")
                return
            self.connecting = False
            self._flush()
            return
        if mask & selectors.EVENT_WRITE:
            self._flush()
        if mask & selectors.EVENT_READ and not self.closed and self.stuck_since is None:
            self._read()

    def _read(self) -> None:
        budget = _READ_BUDGET
        while budget > 0:
            try:
                data = self.sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(f"control link to {self.label} failed: {exc}")
                return
            if not data:
                self.close(f"{self.label} closed the control link")
                return
            self._in += data
            budget -= len(data)
            if len(data) < _READ_CHUNK:
                break
        self.last_rx = self._progress.clock.now()
        self._parse()

    def _parse(self) -> None:
        head = LENGTH.size
        while len(self._in) >= head and not self.closed and self.stuck_since is None:
            (length,) = LENGTH.unpack_from(self._in)
            try:
                CONTROL.check_length(length, None if self.handshaken else PRE_HANDSHAKE_MAX_FRAME)
                if len(self._in) < head + length:
                    return
                msg = CONTROL.unpack(bytes(self._in[head:head + length]))
            except ProtocolError as exc:
                self.refuse(str(exc))
                return
            del self._in[:head + length]
            if isinstance(msg, ErrorMessage):
                self.close(f"{self.label} hung up: {msg.reason}")
                return
            self._on_message(self, msg)

    # -- closing ----------------------------------------------------------
    def refuse(self, reason: str) -> None:
        """Tell the peer why (best effort) and hang up."""
        self.send(ErrorMessage(reason))
        self.close(f"protocol error from {self.label}: {reason}")

    def close(self, reason: str) -> None:
        """Close once; the owner's `on_close(link, reason)` runs exactly once, at the loop's next turn."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self._out and not self.connecting:
            try:  # best effort: a farewell frame (Abort, ErrorMessage) is worth one try
                self.sock.send(self._out)
            except OSError:
                pass
        self._out.clear()
        if self._events:
            try:
                self._progress.selector.unregister(self.sock)
            except (KeyError, ValueError, OSError):
                pass
        self.sock.close()
        # Queued, not called: a close may happen inside a send or a handler (#29.1).
        self._progress.call(self._on_close, self, reason)

    def _update_interest(self) -> None:
        if self.closed:
            return
        want = selectors.EVENT_READ if self.stuck_since is None else 0
        if self.connecting or self._out:
            want |= selectors.EVENT_WRITE
        if self.connecting:
            want = selectors.EVENT_WRITE
        if want == self._events:
            return
        sel = self._progress.selector
        if self._events:
            sel.modify(self.sock, want, self._on_event)
        else:
            sel.register(self.sock, want, self._on_event)
        self._events = want
