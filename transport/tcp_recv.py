"""The receiving half of a tcp link: check each header, then land its payload in place.

One `InboundStream` thread per accepted socket. Every `Segments` header is
checked against the region we registered — region known, every range inside
it, no two overlapping (vectorised, `segments.check_ranges`) — before one
byte of its payload is read; then `recvmsg_into` fills the destination slices
directly, hundreds per call. A header that fails the check means not one byte
of that payload is read: the peer gets `Refused` (or the wire's
`ErrorMessage` for a malformed frame), the reason is logged, and the stream
is closed.

Streams of one sending link share a `LinkState` that counts stripe ends per
transfer; the stream that lands a transfer's last stripe delivers its notify
and sends the `Ack`, so both follow every byte of every stripe.

The fence (`fence()`, used by `drop_peer` and `close`): set `dropped`, shut the
socket down (which wakes a blocked recv), then take the landing lock, which a
stream holds for the whole of each payload read and of each notify delivery,
and under which it checks `dropped` first. When `fence()` returns no byte of
that stream lands again and no notify of it starts or is still running —
except one whose handler itself called `drop_peer`/`close` (the lock is
re-entrant for exactly that). Trap: a handler that waits for *another*
thread's `drop_peer` of the same peer would deadlock; handlers must stay short.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import numpy as np

from .errors import PeerLostError, ProtocolError, TransferTimeout
from .listener import Slot
from .segments import check_ranges
from .tcp_io import recv_all, slices
from .tcp_wire import (
    MAX_ROWS,
    PROTOCOL,
    Ack,
    Hello,
    Refused,
    RegionQuery,
    RegionReply,
    Segments,
    StripeEnd,
    Welcome,
)
from .wire import HANDSHAKE_MAX_FRAME, ErrorMessage

log = logging.getLogger(__name__)
MAX_STREAMS = 64


class _Refusal(Exception):
    """A header we will not honour; carries what `Refused` tells the peer."""

    def __init__(self, transfer: int, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.transfer, self.cause, self.reason = transfer, cause, reason


class LinkState:
    """Stripe accounting shared by the streams of one sending link."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.refs = 0
        self._lock = threading.Lock()
        self._open: dict[int, list[Any]] = {}  # transfer -> [stripes, left, notify]

    def stripe_done(self, transfer: int, stripes: int, notify: bytes | None) -> tuple[bool, bytes | None]:
        """Count one stripe end; `(True, notify)` when it was the transfer's last."""
        with self._lock:
            entry = self._open.setdefault(transfer, [stripes, stripes, None])
            if entry[0] != stripes:
                raise ProtocolError(
                    f"transfer {transfer} announced {stripes} stripes after {entry[0]}"
                )
            if notify is not None:
                if entry[2] is not None:
                    raise ProtocolError(f"transfer {transfer} carried two notify payloads")
                entry[2] = notify
            entry[1] -= 1
            if entry[1]:
                return False, None
            del self._open[transfer]
            return True, entry[2]


class InboundStream:
    """One accepted socket: handshake, then headers and payloads until EOF or fence."""

    def __init__(self, engine: Any, sock: socket.socket, peer: str, slot: Slot) -> None:
        self.engine = engine  # the owning TcpEngine: regions, notify delivery, link table
        self.sock = sock
        self.slot = slot  # our place in the listener's pre-handshake budget
        self.where = f"tcp stream from {peer}"
        self.sender: str | None = None
        self.state: LinkState | None = None
        self.link = ""  # the sending link's id, set by the engine on attach
        self.dropped = False
        self.landing = threading.RLock()
        self._sock_lock = threading.Lock()
        self._bounce = engine.new_bounce()
        self._transfer: int | None = None  # the transfer whose stripe is arriving
        self._got = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"tcp-recv {peer}")

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the stream's thread: close() joins what the engine started."""
        # not started: close() won the race with the accept, which then closes it
        if threading.current_thread() is not self.thread and self.thread.ident is not None:
            self.thread.join(timeout)

    def fence(self) -> None:
        """Stop this stream for good: after return, no byte of it lands."""
        self.dropped = True
        self._shutdown()
        with self.landing:
            pass

    def _shutdown(self) -> None:
        with self._sock_lock:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed or never fully connected

    def _say(self, msg: Any) -> None:
        """Best effort: the peer may be gone already, and we are hanging up anyway."""
        try:
            PROTOCOL.send(self.sock, msg)
        except (PeerLostError, OSError):
            pass

    def _run(self) -> None:
        try:
            self._serve()
        except (PeerLostError, TransferTimeout) as exc:
            log.debug("%s ended: %s", self.where, exc)
        except _Refusal as exc:
            log.warning("closing %s: refused transfer %d: %s", self.where, exc.transfer, exc.reason)
            self._say(Refused(transfer=exc.transfer, cause=exc.cause, reason=exc.reason))
        except ProtocolError as exc:
            log.warning("closing %s: %s", self.where, exc)
            self._say(ErrorMessage(reason=str(exc)))
        except Exception as exc:  # our bug: log it, tell the peer, close — never crash the engine
            log.exception("closing %s after an internal error", self.where)
            self._say(ErrorMessage(reason=f"internal error: {exc}"))
        finally:
            self.dropped = True
            self.slot.admitted()
            self.engine._detach(self)
            self._shutdown()
            with self._sock_lock:
                self.sock.close()

    def _serve(self) -> None:
        # the listener set the handshake timeout; until Welcome, frames are capped small
        hello = PROTOCOL.recv(self.sock, HANDSHAKE_MAX_FRAME)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected hello as the first frame, got {type(hello).TYPE}")
        if not (1 <= hello.streams <= MAX_STREAMS and 0 <= hello.stream < hello.streams):
            raise ProtocolError(
                f"hello names stream {hello.stream} of {hello.streams}; at most {MAX_STREAMS} streams"
            )
        self.sender = hello.engine
        self.where = f"tcp stream {hello.stream} from engine {hello.engine}"
        self.state = self.engine._attach(self, hello.link, hello.streams)
        PROTOCOL.send(self.sock, Welcome(engine=self.engine.engine_id))
        self.sock.settimeout(None)
        self.slot.admitted()
        try:
            while not self.dropped:
                msg = PROTOCOL.recv(self.sock)
                if self.dropped:
                    return
                if isinstance(msg, Segments):
                    self._segments(msg)
                elif isinstance(msg, StripeEnd):
                    self._stripe_end(msg)
                elif isinstance(msg, RegionQuery):
                    region = self.engine.regions.get(msg.region)
                    PROTOCOL.send(self.sock, RegionReply(
                        query=msg.query, region=msg.region,
                        length=region.length if region is not None else -1,
                        device=region.device if region is not None else "",
                    ))
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} frame on a data stream")
        except (OSError, ConnectionError) as exc:
            raise PeerLostError(f"{self.where}: {exc}") from exc

    def _segments(self, msg: Segments) -> None:
        if self._transfer is None:
            self._transfer, self._got = msg.transfer, 0
        elif msg.transfer != self._transfer:
            raise ProtocolError(
                f"segments of transfer {msg.transfer} inside the stripe of transfer {self._transfer}"
            )
        region = self.engine.regions.get(msg.region)
        if region is None:
            raise _Refusal(msg.transfer, "region",
                           f"engine {self.engine.engine_id} has no region {msg.region}")
        raw = msg.ranges
        if not raw or len(raw) % 16 or len(raw) // 16 > MAX_ROWS:
            raise ProtocolError(
                f"transfer {msg.transfer}: ranges of {len(raw)} B is not 1..{MAX_ROWS} int64 pairs"
            )
        ranges = np.frombuffer(raw, dtype="<i8").reshape(-1, 2).astype(np.int64)
        what = f"transfer {msg.transfer} into region {msg.region}"
        nbytes = check_ranges(ranges, region.length, what)
        with self.landing:
            if self.dropped:
                return
            if region.view is not None and not self.engine.force_bounce:
                recv_all(self.sock, *slices(region.view, ranges[:, 0], ranges[:, 1]))
            else:
                for batch in self._bounce.plan(ranges, MAX_ROWS):
                    recv_all(self.sock, [self._bounce.space(int(batch[:, 1].sum()))])
                    self._bounce.scatter(region.data, batch, 0)
        self._got += nbytes

    def _stripe_end(self, msg: StripeEnd) -> None:
        if self._transfer is not None and msg.transfer != self._transfer:
            raise ProtocolError(f"end of transfer {msg.transfer} inside transfer {self._transfer}")
        if msg.nbytes != self._got:
            raise ProtocolError(
                f"transfer {msg.transfer}: stripe claims {msg.nbytes} B, {self._got} B arrived"
            )
        assert self.state is not None
        if not 1 <= msg.stripes <= self.state.streams:
            raise ProtocolError(
                f"transfer {msg.transfer} claims {msg.stripes} stripes over {self.state.streams} streams"
            )
        self._transfer, self._got = None, 0
        done, notify = self.state.stripe_done(msg.transfer, msg.stripes, msg.notify)
        if not done:
            return
        # The notify starts under the landing lock, so a fence either waits it
        # out or keeps it from starting (re-entrant: the handler may drop_peer).
        with self.landing:
            if self.dropped:
                return
            if notify is not None:
                self.engine._deliver(self.sender, notify)
        PROTOCOL.send(self.sock, Ack(transfer=msg.transfer))
