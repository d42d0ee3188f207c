"""The decode side: announces requests to prefills and receives their caches.

A serving worker allocates destination entries and calls
`expect(request_id, prefill_addr, {pool: dst_indices})`. The first request to
a prefill dials its bootstrap address and runs the handshake (the request is
Bootstrapping meanwhile). A host name is resolved off the progress thread
(`resolver`); a prefill not reachable yet — a decode started first — is
dialled again with backoff until `connect_timeout` has passed, and only then
are its requests failed, as "cannot reach", never "lost". A refused
handshake (a layout mismatch: the pool and field named, before any byte
could move) fails the requests waiting for it and tells the prefill which
ones, in the same words, so its senders fail at once too. The link is then
cached and reused; a lost link is forgotten, so the next request dials
afresh — a restarted prefill on the same port serves it.

What a request may do next is its `lifecycle.DecodeLife`'s decision; this
module is its driver. Success is declared from the transport's notifies
alone (`on_landed`). The contract: once `poll()` says Success or Failed, no
byte of that request lands afterwards. A request failing while the prefill
may still write asks it (`Abort`) and finishes on a clean `AbortAck`, or —
cut transfers, a dead link, no ack within the grace — after `drop_peer` has
fenced that prefill (`Fence`); the prefill then hears `Fenced`, so it opens
a fresh data connection instead of writing into the fenced one. Over a
transport that cannot fence (`capabilities.fence` False) such a request is
Quarantined instead (`Quarantine`), until the prefill's Abort/AbortAck says
nothing of it flies, or — its link lost — the transport reports no open link
from that prefill (`has_peer`, asked each tick). docs/reliability.md, #11.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any

from pdxfer.transport.errors import ProtocolError

from .config import EngineConfig, KVPoll
from .decode_dials import Dials
from .engine import Engine
from .handshake import welcome_mismatch, why_lost
from .inbound import DecodeRequest, PrefillPeer, expect_message
from .lifecycle import DecodeLife, DPhase, Fence, Finish, Quarantine, Send, Timing
from .protocol import Abort, AbortAck, Fenced, Ping, Refuse, Welcome, decode_notify
from .requests import check_request_id
from .resolver import Lookups
from .session import Link, parse_address

log = logging.getLogger("pdxfer")


class DecodeEngine(Dials, Engine):
    """The receiving side; dials prefills on demand and fences them when they misbehave."""

    role = "decode"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None) -> None:
        self._sessions: dict[str, PrefillPeer] = {}
        self._xids = itertools.count(1)
        super().__init__(pools, config)
        self._lookups = Lookups(f"pdxfer-resolve-{self.engine_id}",
                                lambda *a: self._progress.call(self._resolved, *a))
        self._timing = Timing(self.config.request_wait, self.config.grace)
        self._transport.set_notify_handler(self._on_notify)
        self._can_fence = self._transport.capabilities.fence
        if not self._can_fence:
            log.warning("pdxfer decode: transport %s cannot fence a peer; failed requests stay "
                        "Quarantined until their prefill confirms or is gone", self.config.transport)

    # -- the public calls ---------------------------------------------------------
    def expect(self, request_id: str, prefill_addr: str, indices: Mapping[str, Any]) -> None:
        """Announce a request and the destination entries (per pool) its cache goes to.

        Validates the id and every index up front (`LayoutError`, `RequestError`);
        a duplicate id is refused. Returns at once: the handshake, if this is
        the first request to that prefill, runs in the background.
        """
        rid = check_request_id(request_id)
        parse_address(prefill_addr)
        xid = next(self._xids)
        dst, msg = expect_message(self._pools.arenas, rid, xid, indices)
        with self._lock:
            self._check_open()
            life = DecodeLife(rid, xid, msg, self._timing, time.monotonic(), fence=self._can_fence)
            req = DecodeRequest(rid, life, dst, prefill_addr)
            self._table.add(req)
        self._progress.call(self._start, req)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Give up on a request: the prefill hears at once; Failed once no byte can land."""
        rid = check_request_id(request_id)
        with self._lock:
            req = self._table.get(rid)
            self._apply(req, req.life.on_abort(f"aborted by decode: {reason}", time.monotonic()))
        self._progress.kick()

    # -- effects (lock held) ---------------------------------------------------------------
    def _apply(self, req: DecodeRequest, effects: list) -> bool:
        """Carry out a transition's effects; True if the request waits for a fence (run it unlocked)."""
        fence = False
        for eff in effects:
            if isinstance(eff, Finish):
                self._table.finish(req, eff.ok, eff.reason, eff.error)
                if req.session is not None:
                    req.session.requests.discard(req.id)
            elif isinstance(eff, Send):
                if req.session is not None and req.session.link is not None:
                    if self._progress.on_thread:
                        req.session.link.send(eff.msg)
                    else:  # off the loop: the caller kicks it once unlocked
                        self._progress.post(req.session.link.send, eff.msg)
            elif isinstance(eff, Fence):
                fence = True
            elif isinstance(eff, Quarantine):
                log.warning("pdxfer decode: request %r quarantined: %s", req.id, eff.reason)
                self._table.quarantine(req, eff.reason, eff.error)
        self._table.advance(req, req.life.poll)
        return fence

    def quarantined(self) -> list[str]:
        """Ids of requests Quarantined now: failed, entries still not the caller's (no fence)."""
        with self._lock:
            return [r.id for r in self._table.running() if r.state is KVPoll.Quarantined]

    def _fence(self, session: PrefillPeer, reqs: list[DecodeRequest]) -> None:
        """drop_peer the prefill, tell it, then finish `reqs`: no byte of theirs lands after. No lock."""
        if not reqs:
            return
        if session.engine is not None:
            self._transport.drop_peer(session.engine)
            if session.link is not None:
                session.link.send(Fenced())  # before any later Expect on this link
        with self._lock:
            for req in reqs:
                self._apply(req, req.life.on_fenced())

    # -- request flow (progress thread unless said otherwise) ------------------------
    def _doom(self, session: PrefillPeer) -> None:
        """Tell a prefill that refused us which requests that fails, in the words they fail with.

        An `Abort` per waiting request, sent before we hang up: the prefill
        fails its senders of those ids at once (#18). A prefill that has
        already hung up never reads them, which costs nothing.
        """
        reason, _ = why_lost(session.addr, session.refusal, "")
        with self._lock:
            doomed = [(r.id, r.life.xid) for r in session.waiting]
        for rid, xid in doomed:
            session.link.send(Abort(rid, xid, reason, False))

    def _on_notify(self, sender: str, payload: bytes) -> None:
        """Transport thread: one transfer of some request landed. Short; never blocks."""
        try:
            msg = decode_notify(payload)
        except ProtocolError as exc:
            log.warning("pdxfer decode: dropping a malformed notify from %s: %s", sender, exc)
            return
        with self._lock:
            req = self._table.find(msg.request)
            if (not isinstance(req, DecodeRequest) or req.life.xid != msg.xid or req.session is None
                    or req.session.engine != sender):
                return  # stale (an earlier use of the id) or not from its prefill
            if req.life.phase in (DPhase.EXPECTED, DPhase.RECEIVING):
                req.nbytes += msg.nbytes
                req.segments += msg.segments
                req.transfers += 1
            self._apply(req, req.life.on_landed(msg.chunk, msg.part, msg.parts, msg.last,
                                                time.monotonic()))
        self._progress.kick()

    # -- control messages (progress thread) -----------------------------------------
    def _on_message(self, link: Link, msg: Any) -> None:
        session: PrefillPeer = link.owner
        if isinstance(msg, Ping):
            return
        if not session.ready:
            if isinstance(msg, Welcome):
                self._on_welcome(session, msg)
            elif isinstance(msg, Refuse):
                session.refusal = (msg.kind, msg.reason)
                log.warning("pdxfer decode: prefill at %s refused the handshake (%s): %s",
                            session.addr, msg.kind, msg.reason)
                self._doom(session)
                link.close(f"prefill at {session.addr} refused the handshake: {msg.reason}")
            else:
                link.refuse(f"expected welcome or refuse, got {type(msg).TYPE!r}")
            return
        if not isinstance(msg, (Abort, AbortAck)):
            return link.refuse(f"a decode does not accept {type(msg).TYPE!r} messages")
        with self._lock:
            req = self._table.find(msg.request)
            if not isinstance(req, DecodeRequest) or req.life.xid != msg.xid or req.session is not session:
                return
            life = req.life
            fence = self._apply(req, life.on_abort_ack(msg.clean) if isinstance(msg, AbortAck)
                                else life.on_peer_abort(msg.reason, msg.fence))
        if fence:
            self._fence(session, [req])

    def _on_welcome(self, session: PrefillPeer, msg: Welcome) -> None:
        assert session.link is not None
        try:
            reason = welcome_mismatch(self._pools, msg)
        except ProtocolError as exc:
            return session.link.refuse(str(exc))
        if reason is not None:
            session.refusal = ("layout", reason)
            log.warning("pdxfer decode: refused prefill at %s: %s", session.addr, reason)
            self._doom(session)
            return session.link.close(f"layout mismatch with prefill at {session.addr}")
        session.engine = msg.engine
        session.ready = True
        session.link.label = f"prefill {msg.engine} at {session.addr}"
        now = time.monotonic()
        with self._lock:
            for req in session.waiting:
                try:  # one request's failure to go out must not stop the others' Expects
                    self._apply(req, req.life.on_link_ready(now))
                except Exception as exc:  # noqa: BLE001 — reported on that request, not lost
                    self._table.finish(req, False, f"expect could not be sent: {exc}", exc)
            session.waiting.clear()

    def _link_lost(self, link: Link, reason: str) -> None:
        session: PrefillPeer = link.owner
        if self._closed:
            return  # close() fails the requests itself, after the transport is down
        if link.connecting:  # it never connected: nothing was lost
            if session.link is link:
                self._not_reached(session, reason)
            return
        if self._sessions.get(session.addr) is session:
            del self._sessions[session.addr]  # the next request dials afresh
        reason, error = why_lost(session.addr, session.refusal, reason)
        with self._lock:
            reqs = session.waiting + [r for rid in session.requests
                                      if isinstance(r := self._table.find(rid), DecodeRequest)
                                      and r.session is session]
            session.waiting.clear()
            fence = [r for r in reqs if self._apply(r, r.life.on_link_lost(reason, error))]
        self._fence(session, fence)

    # -- timers (progress thread) ----------------------------------------------------
    def _tick(self, now: float) -> float:
        cfg = self.config
        close, wake = self._tick_dials(now)  # first: a request unreached says so, not "timed out"
        fences: dict[int, tuple[PrefillPeer, list[DecodeRequest]]] = {}
        with self._lock:
            for req in self._table.running():
                if self._apply(req, req.life.on_tick(now)) and req.session is not None:
                    fences.setdefault(id(req.session), (req.session, []))[1].append(req)
            aborting = any(r.life.phase is DPhase.ABORTING for r in self._table.running())
            orphans = [(r, r.session.engine) for r in self._table.running()
                       if r.life.phase is DPhase.ORPHANED and r.session is not None]
        gone = [r for r, engine in orphans if engine is None or not self._transport.has_peer(engine)]
        if gone:
            with self._lock:
                for req in gone:
                    self._apply(req, req.life.on_peer_gone())
        for session in list(self._sessions.values()):
            link = session.link
            if link is None or link.closed or link.connecting:
                continue
            if not session.ready and now - link.opened > cfg.bootstrap_wait:
                close.append((link, f"handshake with prefill at {session.addr} did not finish "
                                    f"within {cfg.bootstrap_wait} s"))
        close += self._watch([s.link for s in self._sessions.values() if s.link is not None], now,
                             lambda link: not link.connecting)
        self._close_links(close)
        for session, reqs in fences.values():
            self._fence(session, reqs)
        return 0.005 if aborting else min(0.1, cfg.heartbeat / 2, wake)

    # -- close ----------------------------------------------------------------
    def _shutdown(self) -> None:
        self._run_on_progress(self._shutdown_on_thread, self.config.shutdown_wait)
        self._lookups.close(self.config.shutdown_wait)

    def _shutdown_on_thread(self) -> None:
        with self._lock:
            for req in self._table.running():
                session = req.session
                if (req.life.phase in (DPhase.EXPECTED, DPhase.RECEIVING, DPhase.ABORTING)
                        and session is not None and session.link is not None):
                    session.link.send(Abort(req.id, req.life.xid, "decode engine closed", False))
        for session in list(self._sessions.values()):
            if session.link is not None:
                session.link.close("decode engine closed")
