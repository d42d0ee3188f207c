"""The sending half of a tcp link: striped streams, straight from registered memory.

A `TcpConnection` is N TCP streams to one peer engine, each with a writer
thread (sends the stripes queued to it, in order) and a reader thread (acks,
region replies, refusals). `write` checks everything it can on the caller's
thread — local region, descriptor, the peer's real region length (asked once
per region per link and cached), the table against both lengths, the notify
payload — so bad input is refused before anything is queued and the link
stays usable. Then the table is cut into byte-balanced stripes, one per
stream, and the handle completes when the peer acks: after every stripe's
bytes landed and the notify was delivered.

Payload buffers are memoryviews of the registered source memory handed to
`sendmsg` — no staging copy — except CUDA memory, which goes through the
stream's pinned bounce buffer (see `tcp_io.Bounce`).

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
import uuid
from typing import Any

import numpy as np

from .base import Connection, LocalRegion, TransferHandle
from .copying import coalesce_posted
from .errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from .handles import Handle
from .regions import Region, check_descriptor
from .segments import as_table, check_notify, check_table
from .streams import capture
from .tcp_io import Bounce, batches, plan_stripes, send_all, slices
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
from .wire import ErrorMessage

log = logging.getLogger(__name__)
_JOIN_TIMEOUT = 2.0


def tune(sock: socket.socket) -> None:
    """Socket options every stream gets: no Nagle delay on small frames, keepalive for dead hosts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


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


class TcpConnection(Connection):
    """A striped link to one peer tcp engine."""

    def __init__(self, engine: Any, host: str, port: int, peer: str, streams: int) -> None:
        self._engine = engine  # the owning TcpEngine: regions, bounce settings, timeouts
        self.peer = peer
        self._where = f"tcp engine {peer} at {host}:{port}"
        self._lock = threading.Lock()
        self._error: TransportError | None = None
        self._pending: dict[int, Handle] = {}
        self._queries: dict[int, list[Any]] = {}  # id -> [Event, RegionReply | None]
        self._lengths: dict[int, int] = {}  # peer region id -> verified length
        self._ids = itertools.count(1)
        self._turn = itertools.count()  # round-robin start stream of each transfer
        link = uuid.uuid4().hex
        self._streams: list[_Stream] = []
        try:
            for k in range(streams):
                hello = Hello(engine=engine.engine_id, link=link, stream=k, streams=streams)
                sock = self._open(host, port, hello)
                self._streams.append(_Stream(k, sock, engine.new_bounce()))
        except BaseException:
            for s in self._streams:
                s.sock.close()
            raise
        for s in self._streams:
            s.threads = [
                threading.Thread(target=self._write_loop, args=(s,), daemon=True,
                                 name=f"tcp-send {peer}#{s.index}"),
                threading.Thread(target=self._read_loop, args=(s,), daemon=True,
                                 name=f"tcp-acks {peer}#{s.index}"),
            ]
            for t in s.threads:
                t.start()

    def _open(self, host: str, port: int, hello: Hello) -> socket.socket:
        timeout = self._engine.connect_timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {self._where}: {exc}") from exc
        try:
            tune(sock)
            PROTOCOL.send(sock, hello)
            reply = PROTOCOL.recv(sock)
            if isinstance(reply, ErrorMessage):
                raise ProtocolError(f"{self._where} refused the handshake: {reply.reason}")
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"{self._where} answered hello with {type(reply).TYPE}")
            if reply.engine != self.peer:
                raise PeerLostError(
                    f"{host}:{port} is engine {reply.engine}, not {self.peer}; "
                    "the address is stale (the peer restarted?) — fetch a fresh one"
                )
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def alive(self) -> bool:
        return self._error is None

    # -- posting ------------------------------------------------------------
    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
        *,
        ready: Any = None,
    ) -> TransferHandle:
        if self._error is not None:
            raise self._error
        src = self._engine.regions.local(local)
        region, length = check_descriptor(remote, "tcp", self.peer)
        table = as_table(segments)
        actual = self._peer_length(region)
        if actual < 0:
            raise RegistrationError(
                f"engine {self.peer} has no region {region} (never registered or "
                "deregistered); ask the peer for a fresh descriptor"
            )
        if actual != length:
            raise RegistrationError(
                f"descriptor says region {region} has {length} B but it has {actual} B; "
                "the descriptor is stale or was edited"
            )
        nbytes = check_table(table, src.length, length)
        payload = check_notify(notify)
        event = capture(ready, src.data.device)
        stripes = plan_stripes(coalesce_posted(table), len(self._streams))
        with self._lock:
            if self._error is not None:
                raise self._error
            tid = next(self._ids)
            handle = Handle(nbytes, f"tcp transfer {tid} to {self.peer}")
            self._pending[tid] = handle
            first = next(self._turn)
            for k, rows in enumerate(stripes):
                stream = self._streams[(first + k) % len(self._streams)]
                stream.put(_Stripe(tid, src, region, rows, len(stripes), payload if k == 0 else None, event))
        return handle

    def _peer_length(self, region: int) -> int:
        """The peer region's real length (-1: unknown), asked once per region and cached."""
        if region in self._lengths:
            return self._lengths[region]
        event = threading.Event()
        with self._lock:
            if self._error is not None:
                raise self._error
            qid = next(self._ids)
            self._queries[qid] = [event, None]
        self._streams[0].put(PROTOCOL.pack(RegionQuery(query=qid, region=region)))
        timeout = self._engine.connect_timeout
        if not event.wait(timeout):
            with self._lock:
                self._queries.pop(qid, None)
            raise TransferTimeout(f"{self._where} did not describe region {region} within {timeout} s")
        reply = self._queries.pop(qid)[1]
        if reply is None:
            raise self._error or ClosedError("connection closed")
        if reply.length >= 0:
            self._lengths[region] = reply.length
        return reply.length

    # -- I/O threads --------------------------------------------------------
    def _write_loop(self, stream: _Stream) -> None:
        while True:
            with stream.cond:
                while not stream.queue and self._error is None:
                    stream.cond.wait()
                if self._error is not None:
                    return
                item = stream.queue.popleft()
            try:
                if isinstance(item, bytes):
                    send_all(stream.sock, [memoryview(item)])
                else:
                    self._send_stripe(stream, item)
            except OSError as exc:
                self._fail(PeerLostError(f"sending to {self._where} failed: {exc}"))
                return
            except Exception as exc:  # a bug or a device fault: fail loudly, never hang
                log.exception("tcp writer for %s failed", self._where)
                self._fail(TransportError(f"tcp writer for {self._where} failed: {exc}"))
                return

    def _send_stripe(self, stream: _Stream, item: _Stripe) -> None:
        rows, src = item.rows, item.src
        end = PROTOCOL.pack(StripeEnd(
            transfer=item.transfer, stripes=item.stripes,
            nbytes=int(rows[:, 2].sum()), notify=item.notify,
        ))
        bounce = src.view is None or self._engine.force_bounce
        parts = list(stream.bounce.plan(rows, MAX_ROWS) if bounce else batches(rows, MAX_ROWS))
        if not parts:
            send_all(stream.sock, [memoryview(end)])
            return
        for j, batch in enumerate(parts):
            ranges = np.ascontiguousarray(batch[:, 1:], dtype="<i8").tobytes()
            head = PROTOCOL.pack(Segments(transfer=item.transfer, region=item.region, ranges=ranges))
            bufs = [memoryview(head)]
            if bounce:
                bufs.append(stream.bounce.gather(src.data, batch, 0, item.ready))
                sizes = None
            else:
                payload, lengths = slices(src.view, batch[:, 0], batch[:, 2])
                bufs += payload
                sizes = [len(head), *lengths]
            if j == len(parts) - 1:
                bufs.append(memoryview(end))  # rides the same sendmsg as the last payload
                if sizes is not None:
                    sizes.append(len(end))
            send_all(stream.sock, bufs, sizes)

    def _read_loop(self, stream: _Stream) -> None:
        while True:
            try:
                msg = PROTOCOL.recv(stream.sock)
            except PeerLostError as exc:
                self._fail(PeerLostError(f"lost {self._where}: {exc}"))
                return
            except ProtocolError as exc:
                self._fail(ProtocolError(f"{self._where} sent a bad frame: {exc}"))
                return
            if isinstance(msg, Ack):
                with self._lock:
                    handle = self._pending.pop(msg.transfer, None)
                if handle is not None:
                    handle.complete()
                elif self._error is None:
                    self._fail(ProtocolError(f"{self._where} acked unknown transfer {msg.transfer}"))
                    return
            elif isinstance(msg, RegionReply):
                with self._lock:
                    slot = self._queries.get(msg.query)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
            elif isinstance(msg, Refused):
                with self._lock:
                    handle = self._pending.pop(msg.transfer, None)
                cls = RegistrationError if msg.cause == "region" else ProtocolError
                if handle is not None:
                    handle.fail(cls(f"{self._where} refused {handle.what}: {msg.reason}"))
                self._fail(PeerLostError(
                    f"{self._where} closed the link after refusing transfer {msg.transfer}: {msg.reason}"
                ))
                return
            elif isinstance(msg, ErrorMessage):
                self._fail(ProtocolError(f"{self._where} closed the link: {msg.reason}"))
                return
            else:
                self._fail(ProtocolError(f"{self._where} sent unexpected {type(msg).TYPE}"))
                return

    # -- failure and shutdown -----------------------------------------------
    def _fail(self, error: TransportError) -> None:
        """Kill the link once: every pending handle and query fails with `error`."""
        with self._lock:
            if self._error is None:
                self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
            queries = list(self._queries.values())
        for stream in self._streams:
            with stream.cond:
                stream.queue.clear()
                stream.cond.notify_all()
            try:  # wakes this stream's threads blocked in send / recv
                stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for handle in pending:
            handle.fail(self._error)
        for slot in queries:
            slot[0].set()

    def close(self) -> None:
        self._fail(ClosedError(f"connection to {self._where} closed"))
        me = threading.current_thread()
        for stream in self._streams:
            for t in stream.threads:
                if t is not me:
                    t.join(_JOIN_TIMEOUT)
            stream.sock.close()
