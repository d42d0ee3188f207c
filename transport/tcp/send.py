"""The sending half of a tcp link: striped streams, straight from registered memory.

A `TcpLink` is the kit's `Link` over N TCP streams to one peer engine, each
with a writer thread (sends the stripes queued to it, in order) and a reader
thread (acks, region replies, refusals). The kit runs the checks; what is
tcp's: `resolve` asks the peer for a region's real length once per region
per link (`RegionQuery`, bounded by `connect_timeout`, no lock held), `plan`
cuts the table into byte-balanced stripes (one per stream, off the lock),
and `submit` puts them on the streams' queues — it never touches a socket,
so a stalled peer (full socket buffers) stalls only this link's writers.
The handle completes when the peer acks: after every stripe's bytes landed
and the notify was delivered.

Payload buffers are memoryviews of the registered source memory handed to
`sendmsg` — no staging copy — except CUDA memory, which goes through a slot
of the engine's bounded bounce pool, leased per batch (`bounce.py`).

Dialing: every stream is dialed under one deadline for the whole link
(`transport.dial`: connect + Hello + Welcome), and the engine's close ends a
dial in progress.

Failure: any stream's socket error, EOF, a refusal or a protocol error kills
the whole link (its stripes are interdependent), failing every pending handle
with the cause; `engine.connect` then builds a fresh link.
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import time
import uuid
from typing import Any

import numpy as np

from ..copying import coalesce_posted
from ..dial import Dials, dial
from ..errors import (
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from ..link import Link, LinkContext, Remote
from ..posting import Post
from ..regions import Region
from ..wire import ErrorMessage
from .bounce import Bounce, BouncePool
from .io import batches, plan_stripes, send_all, slices
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
)

log = logging.getLogger(__name__)
JOIN_TIMEOUT = 2.0


class _Stripe:
    __slots__ = ("notify", "ready", "region", "rows", "src", "stripes", "transfer")

    def __init__(self, transfer: int, src: Region, region: int, rows: np.ndarray,
                 stripes: int, notify: bytes | None, ready: Any = None) -> None:
        self.transfer, self.src, self.region = transfer, src, region
        self.rows, self.stripes, self.notify = rows, stripes, notify
        self.ready = ready  # the producer's CUDA event (transport.streams), None for host memory


class _Stream:
    """One socket of a link, its queue of stripes / control frames and its two threads."""

    def __init__(self, index: int, sock: socket.socket, bounce: Bounce) -> None:
        self.index = index
        self.sock = sock
        self.bounce = bounce
        self.cond = threading.Condition()
        self.queue: collections.deque[_Stripe | bytes] = collections.deque()
        self.threads: list[threading.Thread] = []

    def put(self, item: _Stripe | bytes) -> None:
        with self.cond:
            self.queue.append(item)
            self.cond.notify()


class TcpLink(Link):
    """A striped link to one peer tcp engine."""

    def __init__(self, ctx: LinkContext, dials: Dials, address: dict[str, Any], streams: int,
                 bounces: BouncePool) -> None:
        host, port, peer = address["host"], address["port"], address["engine"]
        super().__init__(ctx, peer, f"tcp engine {peer} at {host}:{port}")
        self._bounces = bounces
        self._queries: dict[int, list[Any]] = {}  # id -> [Event, RegionReply | None]
        self._lengths: dict[int, int] = {}  # peer region id -> verified length
        self._qids = itertools.count(1)
        self._turn = itertools.count()  # round-robin start stream of each transfer
        link = uuid.uuid4().hex
        self.incarnation = link  # every stream's Hello names it: the receiver's incarnation
        self.streams: list[_Stream] = []
        deadline = time.monotonic() + ctx.connect_timeout  # one bound for the whole link
        try:
            for k in range(streams):
                hello = Hello(engine=ctx.engine_id, link=link, stream=k, streams=streams)
                sock, _ = dial(dials, host, port, PROTOCOL, hello, peer=peer, what=self.what,
                               timeout=ctx.connect_timeout, deadline=deadline)
                self.streams.append(_Stream(k, sock, bounces.bounce(sending=True)))
        except BaseException:
            for s in self.streams:
                s.sock.close()
            raise
        for s in self.streams:
            s.threads = [
                threading.Thread(target=self._write_loop, args=(s,), daemon=True,
                                 name=f"tcp-send {peer}#{s.index}"),
                threading.Thread(target=self._read_loop, args=(s,), daemon=True,
                                 name=f"tcp-acks {peer}#{s.index}"),
            ]
            for t in s.threads:
                t.start()

    # -- the kit's hooks ----------------------------------------------------------
    def resolve(self, region_id: int) -> Remote | None:
        """The peer region's real length, asked once per region and cached."""
        known = self._lengths.get(region_id)
        if known is not None:
            return Remote(known)
        event = threading.Event()
        with self.lock:
            if self.error is not None:
                raise self.error
            qid = next(self._qids)
            self._queries[qid] = [event, None]
        self.streams[0].put(PROTOCOL.pack(RegionQuery(query=qid, region=region_id)))
        timeout = self.ctx.connect_timeout
        if not event.wait(timeout):
            with self.lock:
                self._queries.pop(qid, None)
            raise TransferTimeout(f"{self.what} did not describe region {region_id} within {timeout} s")
        with self.lock:
            reply = self._queries.pop(qid)[1]
        if reply is None:
            raise self.error or PeerLostError(f"{self.what}: the link closed")
        if reply.length < 0:
            return None
        self._lengths[region_id] = reply.length
        return Remote(reply.length)

    def plan(self, src: Region, dst: Remote, table: np.ndarray) -> list[np.ndarray]:
        return plan_stripes(coalesce_posted(table), len(self.streams))

    def submit(self, post: Post) -> None:
        stripes = post.table
        first = next(self._turn)
        region = post.region
        for k, rows in enumerate(stripes):
            stream = self.streams[(first + k) % len(self.streams)]
            stream.put(_Stripe(post.seq, post.src, region, rows, len(stripes),
                               post.notify if k == 0 else None, post.ready))

    def on_sever(self, error: TransportError) -> None:
        with self.lock:
            queries = list(self._queries.values())
        for stream in self.streams:
            with stream.cond:
                stream.queue.clear()
                stream.cond.notify_all()
            try:  # wakes this stream's threads blocked in send / recv
                stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for slot in queries:
            slot[0].set()

    def finish(self) -> None:
        me = threading.current_thread()
        for stream in self.streams:
            for t in stream.threads:
                if t is not me:
                    t.join(JOIN_TIMEOUT)
            stream.sock.close()

    # -- I/O threads ----------------------------------------------------------------
    def _write_loop(self, stream: _Stream) -> None:
        while True:
            with stream.cond:
                while not stream.queue and self.error is None:
                    stream.cond.wait()
                if self.error is not None:
                    return
                item = stream.queue.popleft()
            try:
                if isinstance(item, bytes):
                    send_all(stream.sock, [memoryview(item)])
                else:
                    self._send_stripe(stream, item)
            except BlockingIOError:  # the send timeout armed while a bounce slot was held
                self.sever(PeerLostError(
                    f"{self.what} did not take a bounced batch within {stream.bounce.timeout} s "
                    "while this stream held a slot of the engine's shared bounce pool; taken "
                    "for stalled and cut, which frees the slot"))
                return
            except OSError as exc:
                self.sever(PeerLostError(f"sending to {self.what} failed: {exc}"))
                return
            except TransportError as exc:  # no bounce slot freed in time
                self.sever(exc)
                return
            except Exception as exc:  # a bug or a device fault: fail loudly, never hang
                log.exception("tcp writer for %s failed", self.what)
                self.sever(TransportError(f"tcp writer for {self.what} failed: {exc}"))
                return

    def _send_stripe(self, stream: _Stream, item: _Stripe) -> None:
        rows, src = item.rows, item.src
        end = PROTOCOL.pack(StripeEnd(
            transfer=item.transfer, stripes=item.stripes,
            nbytes=int(rows[:, 2].sum()), notify=item.notify,
        ))
        if src.view is None or self._bounces.force:
            self._send_bounced(stream, item, end)
            return
        parts = list(batches(rows, MAX_ROWS))
        if not parts:
            send_all(stream.sock, [memoryview(end)])
            return
        for j, batch in enumerate(parts):
            head = self._head(item, batch)
            payload, lengths = slices(src.view, batch[:, 0], batch[:, 2])
            bufs, sizes = [memoryview(head), *payload], [len(head), *lengths]
            if j == len(parts) - 1:
                bufs.append(memoryview(end))  # rides the same sendmsg as the last payload
                sizes.append(len(end))
            send_all(stream.sock, bufs, sizes)

    @staticmethod
    def _head(item: _Stripe, batch: np.ndarray) -> bytes:
        ranges = np.ascontiguousarray(batch[:, 1:], dtype="<i8").tobytes()
        return PROTOCOL.pack(Segments(transfer=item.transfer, region=item.region, ranges=ranges))

    def _send_bounced(self, stream: _Stream, item: _Stripe, end: bytes) -> None:
        """CUDA (or forced) source: each batch gathered into a leased slot, sent, the slot given back."""
        bounce = stream.bounce
        parts = list(bounce.plan(item.rows, MAX_ROWS))
        if not parts:
            send_all(stream.sock, [memoryview(end)])
            return
        for j, batch in enumerate(parts):
            bufs = [memoryview(self._head(item, batch))]
            with bounce.lease() as slot:
                bufs.append(bounce.gather(slot, item.src.data, batch, 0, item.ready))
                if j == len(parts) - 1:
                    bufs.append(memoryview(end))
                with bounce.held_for(stream.sock, socket.SO_SNDTIMEO) as pace:
                    send_all(stream.sock, bufs, pace=pace)

    def _read_loop(self, stream: _Stream) -> None:
        while True:
            try:
                msg = PROTOCOL.recv(stream.sock)
            except PeerLostError as exc:
                self.sever(PeerLostError(f"lost {self.what}: {exc}"))
                return
            except ProtocolError as exc:
                self.sever(ProtocolError(f"{self.what} sent a bad frame: {exc}"))
                return
            if isinstance(msg, Ack):
                if self.acked([msg.transfer]) and self.error is None:
                    self.sever(ProtocolError(f"{self.what} acked unknown transfer {msg.transfer}"))
                    return
            elif isinstance(msg, RegionReply):
                with self.lock:
                    slot = self._queries.get(msg.query)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
            elif isinstance(msg, Refused):
                cls = RegistrationError if msg.cause == "region" else ProtocolError
                self.refused(msg.transfer, cls(f"{self.what} refused transfer {msg.transfer}: {msg.reason}"))
                self.sever(PeerLostError(
                    f"{self.what} closed the link after refusing transfer {msg.transfer}: {msg.reason}"))
                return
            elif isinstance(msg, ErrorMessage):
                self.sever(ProtocolError(f"{self.what} closed the link: {msg.reason}"))
                return
            else:
                self.sever(ProtocolError(f"{self.what} sent unexpected {type(msg).TYPE}"))
                return
