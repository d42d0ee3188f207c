"""The receiving half of a tcp link: check each header, then land its payload in place.

One `InboundStream` (a kit `InboundLink`) and its thread per accepted socket.
The first frame is read through the listener's capped `read_hello`. Every
`Segments` header is checked against the region we registered — region
known, every range inside it, no two overlapping (vectorised,
`segments.check_ranges`) — before one byte of its payload is read; then
`recvmsg_into` fills the destination slices directly, hundreds per call. A
header that fails the check means not one byte of that payload is read: the
peer gets `Refused` (or the wire's `ErrorMessage` for a malformed frame),
the reason is logged, and the stream is closed.

Streams of one sending link share a `LinkState` (kept by `Links`, the
engine's table of them) that counts stripe ends per transfer; the stream
that lands a transfer's last stripe delivers its notify (through the kit's
`deliver`, so never after a fence) and sends the `Ack`, so both follow every
byte of every stripe.

The fence is the kit's (`InboundLink.fence`): `cut()` shuts the socket down
(waking a blocked recv), then the kit takes `guard`, which a stream holds
for the whole of each payload read and of each notify delivery, and under
which it checks `dead` first. A stream that reads its socket's EOF has
landed everything the peer sent: it ends and settles.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import numpy as np

from ..errors import PeerLostError, ProtocolError, TransferTimeout
from ..inbound import InboundLink, InboundTable
from ..listener import Slot, read_hello
from ..regions import RegionTable
from ..segments import check_ranges
from ..wire import ErrorMessage
from .bounce import BouncePool
from .io import recv_all, slices
from .wire import (
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


class Links:
    """The engine's `LinkState`s by link id: what the streams of one sending link share."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, LinkState] = {}

    def attach(self, link: str, streams: int) -> LinkState:
        with self._lock:
            state = self._states.get(link)
            if state is None:
                state = self._states[link] = LinkState(streams)
            if state.streams != streams:
                raise ProtocolError(f"link {link} announced {streams} streams after {state.streams}")
            state.refs += 1
            return state

    def detach(self, link: str) -> None:
        with self._lock:
            state = self._states.get(link)
            if state is not None:
                state.refs -= 1
                if state.refs == 0:
                    del self._states[link]


class InboundStream(InboundLink):
    """One accepted socket: handshake, then headers and payloads until EOF or fence."""

    def __init__(self, table: InboundTable, sock: socket.socket, where: str, slot: Slot, *,
                 engine_id: str, regions: RegionTable, links: Links, bounces: BouncePool) -> None:
        super().__init__(table, f"tcp stream from {where}")
        self.sock = sock
        self.slot = slot  # our place in the listener's pre-handshake budget
        self._engine_id = engine_id
        self._regions = regions
        self._links = links
        self._bounces = bounces
        self._state: LinkState | None = None
        self._sock_lock = threading.Lock()
        self.bounce = bounces.bounce(sending=False)
        self._transfer: int | None = None  # the transfer whose stripe is arriving
        self._got = 0

    # -- the kit's hooks ------------------------------------------------------------
    def cut(self) -> None:
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

    def run(self) -> None:
        try:
            self._serve()
        except BlockingIOError:  # the receive timeout armed while a bounce slot was held
            log.warning("closing %s: the sender did not send a bounced batch within %s s while "
                        "this stream held a slot of the shared bounce pool", self.where,
                        self.bounce.timeout)
        except TransferTimeout as exc:  # no bounce slot freed in time
            log.warning("closing %s: %s", self.where, exc)
            self._say(ErrorMessage(reason=str(exc)))
        except PeerLostError as exc:
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
            self.slot.admitted()
            self.cut()
            self.ended()
            if self._state is not None and self.incarnation is not None:
                self._links.detach(self.incarnation)
            with self._sock_lock:
                self.sock.close()

    def _serve(self) -> None:
        hello = read_hello(self.sock, PROTOCOL, Hello)
        if not (1 <= hello.streams <= MAX_STREAMS and 0 <= hello.stream < hello.streams):
            raise ProtocolError(
                f"hello names stream {hello.stream} of {hello.streams}; at most {MAX_STREAMS} streams"
            )
        self.where = f"tcp stream {hello.stream} from engine {hello.engine}"
        self.identify(hello.engine, hello.link)
        self._state = self._links.attach(hello.link, hello.streams)
        PROTOCOL.send(self.sock, Welcome(engine=self._engine_id))
        self.sock.settimeout(None)
        self.slot.admitted()
        try:
            while not self.dead:
                msg = PROTOCOL.recv(self.sock)
                if self.dead:
                    return
                if isinstance(msg, Segments):
                    self._segments(msg)
                elif isinstance(msg, StripeEnd):
                    self._stripe_end(msg)
                elif isinstance(msg, RegionQuery):
                    self._region_reply(msg)
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} frame on a data stream")
        except BlockingIOError:
            raise
        except (OSError, ConnectionError) as exc:
            raise PeerLostError(f"{self.where}: {exc}") from exc

    def _region_reply(self, msg: RegionQuery) -> None:
        # Its own frame, not a local of the serving loop: a region looked up there would stay
        # referenced until the next query, past its `deregister` (#19: nothing kept alive).
        region = self._regions.get(msg.region)
        PROTOCOL.send(self.sock, RegionReply(
            query=msg.query, region=msg.region,
            length=region.length if region is not None else -1,
            device=region.device if region is not None else "",
        ))

    def _segments(self, msg: Segments) -> None:
        if self._transfer is None:
            self._transfer, self._got = msg.transfer, 0
        elif msg.transfer != self._transfer:
            raise ProtocolError(
                f"segments of transfer {msg.transfer} inside the stripe of transfer {self._transfer}"
            )
        region = self._regions.get(msg.region)
        if region is None:
            raise _Refusal(msg.transfer, "region",
                           f"engine {self._engine_id} has no region {msg.region}")
        raw = msg.ranges
        if not raw or len(raw) % 16 or len(raw) // 16 > MAX_ROWS:
            raise ProtocolError(
                f"transfer {msg.transfer}: ranges of {len(raw)} B is not 1..{MAX_ROWS} int64 pairs"
            )
        ranges = np.frombuffer(raw, dtype="<i8").reshape(-1, 2).astype(np.int64)
        what = f"transfer {msg.transfer} into region {msg.region}"
        nbytes = check_ranges(ranges, region.length, what)
        if region.view is not None and not self._bounces.force:
            with self.guard:
                if self.dead:
                    return
                recv_all(self.sock, *slices(region.view, ranges[:, 0], ranges[:, 1]))
        else:
            # The slot is leased before the guard (a fence never waits for a lease) and
            # held for this header's payload only, under a receive timeout.
            bounce = self.bounce
            with bounce.lease() as slot, self.guard:
                if self.dead:
                    return
                with bounce.held_for(self.sock, socket.SO_RCVTIMEO) as pace:
                    for batch in bounce.plan(ranges, MAX_ROWS):
                        recv_all(self.sock, [bounce.space(slot, int(batch[:, 1].sum()))], pace=pace)
                        bounce.scatter(slot, region.data, batch, 0)
        self._got += nbytes

    def _stripe_end(self, msg: StripeEnd) -> None:
        if self._transfer is not None and msg.transfer != self._transfer:
            raise ProtocolError(f"end of transfer {msg.transfer} inside transfer {self._transfer}")
        if msg.nbytes != self._got:
            raise ProtocolError(
                f"transfer {msg.transfer}: stripe claims {msg.nbytes} B, {self._got} B arrived"
            )
        assert self._state is not None
        if not 1 <= msg.stripes <= self._state.streams:
            raise ProtocolError(
                f"transfer {msg.transfer} claims {msg.stripes} stripes over {self._state.streams} streams"
            )
        self._transfer, self._got = None, 0
        done, notify = self._state.stripe_done(msg.transfer, msg.stripes, msg.notify)
        if not done:
            return
        # The kit's delivery rule: under `guard`, never once the stream is fenced.
        if not self.deliver((notify,)):
            return
        PROTOCOL.send(self.sock, Ack(transfer=msg.transfer))
