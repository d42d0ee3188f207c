"""The decode side: announces requests to prefills and receives their caches.

A serving worker allocates destination entries and calls
`expect(request_id, prefill_addr, {pool: dst_indices})`. The first request to
a prefill dials its bootstrap address and runs the handshake (the request is
Bootstrapping meanwhile); a layout mismatch fails the request with the pool
and field named, before any byte could move. The link is then cached and
reused; a lost link is forgotten, so the next request dials afresh — a
restarted prefill on the same port serves it.

Success is declared from the transport's notifies alone: each transfer's
`Landed` payload says which chunk it belongs to and how many parts that chunk
has, and the request is complete when the chunk marked last and every chunk
before it have all their parts. The prefill then hears `Done`.

The contract this side keeps: once `poll()` says Success or Failed, no byte
of that request lands afterwards, so the caller may reuse the entries. A
request that fails while the prefill may still be writing (abort, timeout)
therefore does not finish at once: it sends `Abort` and finishes on the
prefill's `AbortAck` (clean), or — if the ack says the prefill had to cut its
transfers, the link is dead, or no ack comes within the grace — after
`drop_peer` has fenced that prefill on the transport. A fence cuts every
in-flight write from that prefill, so it is used only when the prefill is
already unhealthy or gone.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from pdxfer import layout
from pdxfer.transport.errors import CapabilityError, PeerLostError, ProtocolError, TransferTimeout

from .config import EngineConfig, KVPoll
from .engine import Engine
from .errors import RequestError
from .pools import layout_error, mismatch
from .protocol import (
    MAX_FRAME,
    Abort,
    AbortAck,
    Done,
    Expect,
    Hello,
    Ping,
    Refuse,
    Welcome,
    decode_notify,
    pack_indices,
)
from .requests import Request, check_request_id
from .session import Link, parse_address

log = logging.getLogger("pdxfer")
# An Expect carries 8 B per index in one control frame; keep well inside its limit.
_MAX_INDICES = (MAX_FRAME - (64 << 10)) // 8


class DecodeRequest(Request):
    """A request as the decode tracks it: destinations, parts landed, an abort in progress."""

    __slots__ = ("abort_by", "aborting", "complete", "dst", "expect_sent", "landed",
                 "last_chunk", "parts", "prefill_engine", "session")

    def __init__(self, request_id: str, xid: int, deadline: float, dst: dict[str, np.ndarray],
                 addr: str) -> None:
        super().__init__(request_id, xid, deadline)
        self.dst = dst
        self.peer = addr
        self.session: _Prefill | None = None
        self.expect_sent = False
        self.prefill_engine: str | None = None
        self.parts: dict[int, int] = {}  # chunk -> transfers it has
        self.landed: dict[int, int] = {}  # chunk -> transfers landed
        self.complete = 0  # chunks with every part landed
        self.last_chunk: int | None = None
        self.aborting: tuple[str, BaseException | None] | None = None
        self.abort_by = math.inf


class _Prefill:
    """One prefill engine as this decode sees it, keyed by its bootstrap address."""

    __slots__ = ("addr", "engine", "link", "ready", "refusal", "requests", "waiting")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.link: Link | None = None
        self.engine: str | None = None  # the prefill's transport engine id, from Welcome
        self.ready = False
        self.refusal: tuple[str, str] | None = None
        self.waiting: list[DecodeRequest] = []  # until the handshake finishes
        self.requests: set[str] = set()  # Expect sent, not yet finished


class DecodeEngine(Engine):
    """The receiving side; dials prefills on demand and fences them when they misbehave."""

    role = "decode"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None) -> None:
        self._sessions: dict[str, _Prefill] = {}
        self._xids = itertools.count(1)
        super().__init__(pools, config)
        self._transport.set_notify_handler(self._on_notify)

    # -- the public calls ---------------------------------------------------------
    def expect(self, request_id: str, prefill_addr: str, indices: Mapping[str, Any]) -> None:
        """Announce a request and the destination entries (per pool) its cache goes to.

        Validates every index up front (`LayoutError`, `RequestError`); a
        duplicate id is refused. Returns at once: the handshake, if this is
        the first request to that prefill, runs in the background.
        """
        rid = check_request_id(request_id)
        parse_address(prefill_addr)
        if not isinstance(indices, Mapping) or not indices:
            raise RequestError(f"expect({rid!r}): indices must be a non-empty mapping pool -> indices")
        dst = {}
        for pool, idx in indices.items():
            arena = self._pools.arenas.get(pool)
            if arena is None:
                raise RequestError(
                    f"expect({rid!r}): no pool {pool!r} on this decode; pools: {sorted(self._pools.arenas)}"
                )
            dst[pool] = layout.check_indices(arena, idx, what=f"pool {pool!r} destination index",
                                             unique=True)
        count = sum(len(a) for a in dst.values())
        if count > _MAX_INDICES:
            raise RequestError(
                f"expect({rid!r}): {count} destination entries exceed the {_MAX_INDICES} one "
                "request can name; use larger pages or split the request"
            )
        with self._lock:
            self._check_open()
            req = DecodeRequest(rid, next(self._xids), time.monotonic() + self.config.timeout,
                                dst, prefill_addr)
            self._table.add(req)
        self._progress.call(self._start, req)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Give up on a request: the prefill hears at once; Failed once no byte can land."""
        rid = check_request_id(request_id)
        with self._lock:
            req = self._table.get(rid)
            assert isinstance(req, DecodeRequest)
            self._abort(req, f"aborted by decode: {reason}", None)

    # -- request flow (progress thread unless said otherwise) ------------------------
    def _start(self, req: DecodeRequest) -> None:
        if self._closed:
            return
        session = self._sessions.get(req.peer)
        if session is None:
            try:
                session = self._dial(req.peer)
            except OSError as exc:  # no socket, or a host name that does not resolve
                why = f"cannot connect to prefill at {req.peer}: {exc}"
                with self._lock:
                    self._table.finish(req, False, why, PeerLostError(why))
                return
        with self._lock:
            req.session = session
            if not session.ready:
                session.waiting.append(req)
            elif not req.finished:
                self._send_expect(session, req)
            else:
                self._tell_aborted(session, req)

    def _tell_aborted(self, session: _Prefill, req: DecodeRequest) -> None:
        """A request aborted before its Expect went out: a prefill already sending it fails now."""
        if req.state is KVPoll.Failed and session.link is not None:
            session.link.send(Abort(req.id, req.xid, req.reason or "aborted", False))

    def _dial(self, addr: str) -> _Prefill:
        host, port = parse_address(addr)
        session = _Prefill(addr)
        link = Link.dial(host, port, self._progress, f"prefill at {addr}", self._on_message,
                         lambda lk, why: self._progress.call(self._link_lost, lk, why))
        link.owner, session.link = session, link
        self._sessions[addr] = session
        link.send(Hello(self.engine_id, self.config.transport, self._transport.address(),
                        **self._pools.hello_fields()))
        return session

    def _send_expect(self, session: _Prefill, req: DecodeRequest) -> None:
        """Lock held."""
        assert session.link is not None
        session.link.send(Expect(req.id, req.xid, {p: pack_indices(a) for p, a in req.dst.items()}))
        req.expect_sent = True
        req.prefill_engine = session.engine
        session.requests.add(req.id)
        self._table.advance(req, KVPoll.WaitingForInput)
        req.deadline = time.monotonic() + self.config.timeout

    def _abort(self, req: DecodeRequest, reason: str, error: BaseException | None) -> None:
        """Fail `req` now if no byte can come, else start the abort handshake. Lock held, any thread."""
        if req.finished or req.aborting is not None:
            return
        if not req.expect_sent:
            self._table.finish(req, False, reason, error)
            return
        req.aborting = (reason, error)
        req.abort_by = time.monotonic() + self.config.grace
        self._progress.call(self._send_abort, req)

    def _send_abort(self, req: DecodeRequest) -> None:
        with self._lock:
            if req.finished or req.session is None or req.aborting is None:
                return
            assert req.session.link is not None
            req.session.link.send(Abort(req.id, req.xid, req.aborting[0], False))
        self._progress.tick_soon()

    def _on_notify(self, sender: str, payload: bytes) -> None:
        """Transport thread: one transfer of some request landed. Short; never blocks."""
        try:
            msg = decode_notify(payload)
        except ProtocolError as exc:
            log.warning("pdxfer decode: dropping a malformed notify from %s: %s", sender, exc)
            return
        with self._lock:
            req = self._table.find(msg.request)
            if (not isinstance(req, DecodeRequest) or req.xid != msg.xid or req.finished
                    or req.aborting is not None or req.prefill_engine != sender):
                return  # stale (an earlier use of the id) or already given up on
            expected = req.parts.setdefault(msg.chunk, msg.parts)
            if expected != msg.parts or not 0 <= msg.part < msg.parts:
                self._abort(req, f"prefill sent an inconsistent notify for chunk {msg.chunk} "
                            f"(part {msg.part} of {msg.parts}, expected {expected} parts)",
                            ProtocolError("inconsistent notify"))
                return
            got = req.landed.get(msg.chunk, 0) + 1
            req.landed[msg.chunk] = got
            if got == expected:
                req.complete += 1
            if msg.last:
                req.last_chunk = msg.chunk
            req.nbytes += msg.nbytes
            req.segments += msg.segments
            req.transfers += 1
            req.deadline = time.monotonic() + self.config.timeout
            if req.last_chunk is None or req.complete != req.last_chunk + 1:
                self._table.advance(req, KVPoll.Transferring)
                return
            self._table.finish(req, True)
            session = req.session
        self._progress.call(self._send_done, session, req.id, req.xid)

    def _send_done(self, session: _Prefill, rid: str, xid: int) -> None:
        session.requests.discard(rid)
        if session.link is not None:
            session.link.send(Done(rid, xid))

    # -- control messages (progress thread) -----------------------------------------
    def _on_message(self, link: Link, msg: Any) -> None:
        session: _Prefill = link.owner
        if isinstance(msg, Ping):
            return
        if not session.ready:
            if isinstance(msg, Welcome):
                self._on_welcome(session, msg)
            elif isinstance(msg, Refuse):
                session.refusal = (msg.kind, msg.reason)
                link.close(f"prefill at {session.addr} refused the handshake: {msg.reason}")
            else:
                link.refuse(f"expected welcome or refuse, got {type(msg).TYPE!r}")
        elif isinstance(msg, (Abort, AbortAck)):
            self._on_abort_or_ack(session, msg)
        else:
            link.refuse(f"a decode does not accept {type(msg).TYPE!r} messages")

    def _on_welcome(self, session: _Prefill, msg: Welcome) -> None:
        assert session.link is not None
        pools = self._pools
        try:
            reason = mismatch((msg.pools, msg.fingerprints), (pools.descs, pools.fingerprints))
        except (AttributeError, TypeError, KeyError) as exc:
            return session.link.refuse(f"malformed welcome: {exc}")
        if reason is not None:
            session.refusal = ("layout", reason)
            return session.link.close(f"layout mismatch with prefill at {session.addr}")
        session.engine = msg.engine
        session.ready = True
        session.link.label = f"prefill {msg.engine} at {session.addr}"
        with self._lock:
            for req in session.waiting:
                if not req.finished:
                    self._send_expect(session, req)
                else:
                    self._tell_aborted(session, req)
            session.waiting.clear()

    def _on_abort_or_ack(self, session: _Prefill, msg: Abort | AbortAck) -> None:
        with self._lock:
            req = self._table.find(msg.request)
            if (not isinstance(req, DecodeRequest) or req.xid != msg.xid or req.finished
                    or req.session is not session):
                return
            if isinstance(msg, AbortAck):
                if req.aborting is None:
                    return
                reason, error = req.aborting
                fence, why = not msg.clean, "the prefill cut its transfers; fenced it"
            else:
                reason, error = req.aborting or (msg.reason, RequestError(msg.reason))
                fence, why = msg.fence, msg.reason
            if not fence:
                session.requests.discard(req.id)
                self._table.finish(req, False, reason, error)
                return
        self._fence(session, [req], why)

    def _fence(self, session: _Prefill, reqs: list[DecodeRequest], why: str) -> None:
        """drop_peer the prefill, then fail `reqs`: no byte of theirs lands after. No lock held."""
        if session.engine is not None:
            self._transport.drop_peer(session.engine)
        with self._lock:
            for req in reqs:
                session.requests.discard(req.id)
                reason, error = req.aborting or (why, PeerLostError(why))
                self._table.finish(req, False, reason + (f" ({why})" if req.aborting and why else ""),
                                   error)

    def _link_lost(self, link: Link, reason: str) -> None:
        session: _Prefill = link.owner
        if self._closed:
            return  # close() fails the requests itself, after the transport is down
        if self._sessions.get(session.addr) is session:
            del self._sessions[session.addr]  # the next request dials afresh
        error: BaseException
        if session.refusal is not None and session.refusal[0] == "layout":
            error = layout_error(session.refusal[1])
            reason = str(error)
        elif session.refusal is not None:
            error = CapabilityError(session.refusal[1])
            reason = f"prefill at {session.addr} refused: {session.refusal[1]}"
        else:
            reason = f"prefill at {session.addr} lost: {reason}"
            error = PeerLostError(reason)
        with self._lock:
            for req in session.waiting:
                self._table.finish(req, False, reason, error)
            session.waiting.clear()
            bound = [r for rid in session.requests
                     if isinstance(r := self._table.find(rid), DecodeRequest)
                     and r.session is session and not r.finished]
        if bound:
            self._fence(session, bound, reason)

    # -- timers (progress thread) ----------------------------------------------------
    def _tick(self, now: float) -> float:
        cfg = self.config
        overdue: dict[int, tuple[_Prefill, list[DecodeRequest]]] = {}
        silent = []
        with self._lock:
            for req in self._table.running():
                assert isinstance(req, DecodeRequest)
                if req.aborting is not None:
                    if now >= req.abort_by and req.session is not None:
                        overdue.setdefault(id(req.session), (req.session, []))[1].append(req)
                elif req.deadline <= now:
                    msg = (f"request {req.id!r} timed out: no progress for {cfg.timeout} s while "
                           f"{req.state.name} (prefill at {req.peer})")
                    self._abort(req, msg, TransferTimeout(msg))
            aborting = any(r.aborting is not None for r in self._table.running())
        for session in list(self._sessions.values()):
            link = session.link
            if link is None or link.closed:
                continue
            if not session.ready and now - link.opened > cfg.timeout:
                silent.append((link, f"handshake with prefill at {session.addr} did not finish "
                                     f"within {cfg.timeout} s"))
            elif now - link.last_rx > cfg.timeout:
                silent.append((link, f"prefill at {session.addr} silent for "
                                     f"{now - link.last_rx:.1f} s (timeout {cfg.timeout} s)"))
            elif session.ready and now - link.last_tx >= cfg.heartbeat:
                link.send(Ping())
        for link, why in silent:
            link.close(why)
        for session, reqs in overdue.values():
            self._fence(session, reqs, f"prefill did not confirm the abort within {cfg.grace} s; fenced it")
        return 0.005 if aborting else min(0.1, cfg.heartbeat / 2)

    # -- close ----------------------------------------------------------------
    def _shutdown(self) -> None:
        self._run_on_progress(self._shutdown_on_thread, 5.0)

    def _shutdown_on_thread(self) -> None:
        with self._lock:
            for req in self._table.running():
                assert isinstance(req, DecodeRequest)
                session = req.session
                if req.expect_sent and session is not None and session.link is not None:
                    session.link.send(Abort(req.id, req.xid, "decode engine closed", False))
        for session in list(self._sessions.values()):
            if session.link is not None:
                session.link.close("decode engine closed")
