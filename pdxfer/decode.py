"""The decode side: announces requests to prefills and receives their caches.

A serving worker allocates destination entries and calls
`expect(request_id, prefill_addr, {pool: dst_indices})`. The first request to
a prefill dials its bootstrap address and runs the handshake (the request is
Bootstrapping meanwhile; a prefill not reachable yet is redialled within
`connect_timeout`: `decode_dials`); a refused handshake (a layout mismatch:
pool and field named, before any byte could move) fails its requests on
both sides. The link is then cached and reused; a lost link is forgotten, so
the next request dials afresh — a restarted prefill on the same port serves it.

The prefill may be named by a directory record (`pdxfer.directory.PeerRecord`)
instead of an address: its fingerprints are checked before dialing, its
engine id — the incarnation — must be the Welcome's (else the request is
re-resolved through the directory, or fails as a stale record), and a
"replaced" event from the directory cuts the old incarnation's link before
anything queued after it dials the new one. docs/directory.md.

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
its transfers ended *and* the transport shows settled every data link the
word names (`TransportEngine.settled`, asked each tick: the prefill's close
of a link is not a fence here — bytes it sent before may still land, #25.1),
or — its link lost — until the transport shows every link of that prefill
settled. docs/reliability.md, #11 and "What ends a no-fence quarantine".
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
from collections.abc import Mapping
from typing import Any

from pdxfer.transport.errors import PeerLostError, ProtocolError

from . import resizing
from .clock import MONOTONIC, Clock
from .config import EngineConfig, KVPoll
from .decode_dials import Dials
from .directory.records import PeerRecord
from .engine import Engine
from .errors import LayoutMismatchError, RequestError
from .expects import DecodeRequest, PrefillPeer, expect_message
from .handshake import record_mismatch, welcome_mismatch, why_lost
from .lifecycle import DecodeLife, DPhase, Fence, Finish, Quarantine, Send, Timing
from .pools import layout_error
from .protocol import (
    MAX_RENEW,
    Abort,
    AbortAck,
    Fenced,
    Hello,
    Ping,
    Refuse,
    Renew,
    Welcome,
    check_links,
    decode_notify,
)
from .requests import check_request_id
from .session import ControlConn, parse_address

log = logging.getLogger("pdxfer")


class DecodeEngine(Engine):
    """The receiving side; dials prefills on demand and fences them when they misbehave."""

    role = "decode"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None,
                 directory: Any = None, *, clock: Clock = MONOTONIC) -> None:
        self._sessions: dict[str, PrefillPeer] = {}
        self._xids = itertools.count(1)
        # Notifies the transport handed over, applied in bursts by the progress thread.
        self._landed: collections.deque[tuple[str, bytes]] = collections.deque()
        self._landing = False  # a turn of `_apply_landed` is queued
        # What the tick looks at, so a tick costs what is due, not what is held (#29.6):
        # a heap of (wakes_at, seq, request), lazily pruned, and the requests polled
        # against the transport (`DecodeLife.settling`). Both under the table lock.
        self._due: list[tuple[float, int, DecodeRequest]] = []
        self._due_seq = itertools.count()
        self._settling: dict[int, DecodeRequest] = {}
        # Requests queued here and not expected yet, whose prefill's hold we renew
        # (`hold`): id -> prefill address; and when the next Renew goes out. Table lock.
        self._holds: dict[str, str] = {}
        self._renew_at = 0.0
        # A `pdxfer.directory.PeerDirectory` (or anything with its resolve /
        # layout / subscribe): re-resolves a stale record, describes a
        # prefill's pools before dialing, and says when a prefill was replaced.
        # None: records are taken as given, and a bare address checks nothing.
        self._directory = directory
        self._unsubscribe = None
        self._dials: Dials | None = None  # made once the progress loop exists; it may tick first
        super().__init__(pools, config, clock=clock)
        cfg = self.config
        self._dials = Dials(
            sessions=self._sessions, progress=self._progress, lock=self._lock, config=cfg,
            name=self.engine_id,
            hello=lambda: Hello(self.engine_id, cfg.transport, self._transport.address(),
                                **self._pools.hello_fields()),
            # looked up per message, as when Dials was a mixin: a hook installed on the engine
            # after construction (the late-bytes tests' WordSeen) still sees every message
            on_message=lambda link, msg: self._on_message(link, msg),
            on_link_lost=lambda link, why: self._link_lost(link, why),
            fail=self._fail_waiting, closed=lambda: self._closed, on_link=self._observer.on_link)
        self._timing = Timing(self.config.request_wait, self.config.grace)
        self._transport.set_notify_handler(self._on_notify)
        self._can_fence = self._transport.capabilities.fence
        if not self._can_fence:
            log.warning("pdxfer decode: transport %s cannot fence a peer; failed requests stay "
                        "Quarantined until their prefill confirms or is gone", self.config.transport)
        if directory is not None:
            self._unsubscribe = directory.subscribe(self._on_directory)

    # -- the public calls ---------------------------------------------------------
    def expect(self, request_id: str, prefill: str | PeerRecord, indices: Mapping[str, Any], *,
               offsets: Mapping[str, int] | None = None) -> None:
        """Announce a request and the destination entries (per pool) its cache goes to.

        `prefill` is the prefill's bootstrap address, or its directory record
        (`pdxfer.directory.PeerRecord`): then a prefill whose pools cannot
        match ours is refused here, before dialing (`LayoutMismatchError`),
        and its Welcome must come from the record's engine id.
        Validates the id and every index up front (`LayoutError`, `RequestError`);
        a duplicate id is refused. Returns at once: the handshake, if this is
        the first request to that prefill, runs in the background.

        `offsets` (a tail-only Expect, a decode prefix hit): `{pool: k}` — this
        decode already holds the first k entries of what the prefill sends in
        `pool`; `indices[pool]` names destinations for the entries after them
        only, the prefill ships only those, and Success means every one of
        them landed (the held prefix entries are never written).
        """
        rid = check_request_id(request_id)
        record = self.check_prefill(prefill)
        xid = next(self._xids)
        gen = self._pools.generation
        dst, msg = expect_message(self._pools, rid, xid, indices, offsets)
        with self._lock:
            self._check_open()
            if self._pools.generation != gen:  # a resize ran meanwhile: check its live ranges
                dst, msg = expect_message(self._pools, rid, xid, indices, offsets)
            life = DecodeLife(rid, xid, msg, self._timing, self._progress.clock.now(),
                              fence=self._can_fence, depth=self._pools.depth)
            req = DecodeRequest(rid, life, dst, record)
            self._table.add(req)
            self._observer.event(req, "expect", ("prefill={} xid={}", record.address, xid))
            self._holds.pop(rid, None)  # expected now: its Expect takes over the prefill's wait
            self._schedule(req)
        self._progress.call(self._start, req)

    def hold(self, request_id: str, prefill: str | PeerRecord) -> None:
        """Keep the prefill's hold on a request this decode has queued but cannot expect yet.

        For a request admitted and waiting for destination entries (a
        scheduler queue, memory pressure): until `expect()` (or `unhold()`)
        for the id, this decode renews it on the prefill every
        `renew_period` s — one `Renew` per prefill link carrying every held
        id, sent by the progress loop — so a request the prefill already sent
        does not fail its `request_timeout` wait for the Expect. Dials the
        prefill if no link to it exists. Idempotent; returns at once.
        """
        rid = check_request_id(request_id)
        record = self.check_prefill(prefill)
        with self._lock:
            self._check_open()
            self._holds[rid] = record.address
            self._renew_at = 0.0  # the next tick renews: the prefill may be close to its limit
        self._progress.kick()

    def unhold(self, request_id: str) -> bool:
        """Stop renewing a held request (the scheduler dropped it); False if it was not held."""
        rid = check_request_id(request_id)
        with self._lock:
            return self._holds.pop(rid, None) is not None

    @property
    def renew_period(self) -> float:
        """Seconds between renewals of held requests: a third of the request wait, at most a
        heartbeat — several renewals land within any prefill whose request_timeout is ours."""
        return min(self.config.heartbeat, self.config.request_wait / 3)

    def _renew(self, now: float) -> float:
        """Progress thread: send the held ids to their prefills if due; seconds until next due."""
        with self._lock:
            if not self._holds:
                return math.inf
            if now < self._renew_at:
                return self._renew_at - now
            self._renew_at = now + self.renew_period
            by_addr: dict[str, list[str]] = {}
            for rid, addr in self._holds.items():
                by_addr.setdefault(addr, []).append(rid)
        for addr, rids in by_addr.items():
            session = self._sessions.get(addr)
            if session is None:  # no link yet: open one; the next period renews through it
                self._dials.dial(addr, None)
                continue
            if session.ready and session.link is not None and not session.link.closed:
                for i in range(0, len(rids), MAX_RENEW):
                    session.link.send(Renew(rids[i:i + MAX_RENEW]))
        return self.renew_period

    def check_prefill(self, prefill: str | PeerRecord) -> PeerRecord:
        """`prefill` as a record, refused (`LayoutMismatchError`) if its pools cannot match ours.

        Decided from the record's fingerprints and, where one differs, the
        directory's published description; nothing is dialed.
        """
        record = PeerRecord.at(prefill) if isinstance(prefill, str) else prefill
        if not isinstance(record, PeerRecord):
            raise RequestError(f"prefill must be a 'host:port' address or a PeerRecord, got {prefill!r}")
        parse_address(record.address)
        reason = self._refusal(record)
        if reason is not None:
            raise layout_error(f"{reason} (directory record of engine {record.engine}, not dialed)")
        return record

    def _refusal(self, record: PeerRecord) -> str | None:
        describe = self._directory.layout if self._directory is not None else None
        return record_mismatch(self._pools, record.layouts, describe)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Give up on a request: the prefill hears at once; Failed once no byte can land."""
        rid = check_request_id(request_id)
        with self._transition():
            req = self._table.get(rid)
            self._apply(req, req.life.on_abort(f"aborted by decode: {reason}", self._progress.clock.now()))

    # -- effects (inside `_transition()`) ------------------------------------------------
    def _apply(self, req: DecodeRequest, effects: list) -> None:
        """A transition's effects: the table's now; a message or a fence once the lock is released.

        Fences of one prefill queued by one transition run as one `drop_peer`.
        """
        for eff in effects:
            if isinstance(eff, Finish):
                self._table.finish(req, eff.ok, eff.reason, eff.error)
                if req.session is not None:
                    req.session.requests.discard(req.id)
            elif isinstance(eff, Send):
                if req.session is not None and req.session.link is not None:
                    self._observer.event(req, "sent", type(eff.msg).TYPE)
                    self._defer(req.session.link.send, eff.msg)
            elif isinstance(eff, Fence):
                self._defer_batch(self._fence, req.session, req)
            elif isinstance(eff, Quarantine):
                log.warning("pdxfer decode: request %r quarantined: %s", req.id, eff.reason)
                self._table.quarantine(req, eff.reason, eff.error)
        self._table.advance(req, req.life.poll)
        self._schedule(req)

    def _schedule(self, req: DecodeRequest) -> None:
        """Keep `req` where the tick finds it: its deadline in the heap, or in the settling set.

        Lock held. Pushes only when the deadline moved earlier than the entry
        already there (a later one is found when that entry comes due), so a
        notify, which only moves it later, costs a comparison.
        """
        life = req.life
        at = life.wakes_at
        if at is not None and at < req.due and not req.finished:
            req.due = at
            heapq.heappush(self._due, (at, next(self._due_seq), req))
        if life.settling and not req.finished:
            self._settling[id(req)] = req
        else:
            self._settling.pop(id(req), None)

    def _pop_due(self, now: float) -> list[DecodeRequest]:
        """The requests whose deadline passed, off the heap (lock held); stale entries dropped."""
        out = []
        while self._due and self._due[0][0] <= now:
            at, _, req = heapq.heappop(self._due)
            if at != req.due:
                continue  # superseded by an earlier entry, already handled
            req.due = math.inf
            wake = req.life.wakes_at
            if req.finished or wake is None:
                continue
            if wake > now:  # moved later meanwhile: come back then
                req.due = wake
                heapq.heappush(self._due, (wake, next(self._due_seq), req))
            else:
                out.append(req)
        if len(self._due) > 4 * len(self._table) + 1024:  # entries of released records: rebuild
            self._due = [(r.due, next(self._due_seq), r) for r in self._table.running()
                         if isinstance(r, DecodeRequest) and r.due != math.inf]
            heapq.heapify(self._due)
        return out

    def _after_resize(self, names: tuple[str, str]) -> None:
        """Tell every prefill the new live ranges, queued ahead of any later Expect (lock held)."""
        self._progress.post(self._announce, resizing.live_range(self._pools, names))

    def _announce(self, msg: Any) -> None:
        for session in list(self._sessions.values()):
            if session.link is not None:
                session.link.send(msg)

    def _control_links(self) -> list[Any]:
        return [s.link for s in list(self._sessions.values()) if s.link is not None]

    def _links_up(self) -> int:
        return sum(1 for s in list(self._sessions.values()) if s.ready)

    def quarantined(self) -> list[str]:
        """Ids of requests Quarantined now: failed, entries still not the caller's (no fence)."""
        with self._lock:
            return [r.id for r in self._table.running() if r.state is KVPoll.Quarantined]

    def _fence(self, session: PrefillPeer | None, reqs: list[DecodeRequest]) -> None:
        """drop_peer the prefill, tell it, then finish `reqs`: no byte of theirs lands after. No lock."""
        if not reqs:
            return
        if session is not None and session.engine is not None:
            self._transport.drop_peer(session.engine)
            if session.link is not None:
                session.link.send(Fenced())  # before any later Expect on this link
        with self._transition():
            for req in reqs:
                self._apply(req, req.life.on_fenced())

    # -- request flow (progress thread unless said otherwise) ------------------------
    def _start(self, req: DecodeRequest) -> None:
        if self._closed:
            return
        # A request aborted while dialing still binds: the prefill must hear its Abort.
        session = self._sessions.get(req.peer)
        if session is not None and session.link is not None and session.link.closed \
                and not session.link.connecting:
            session = None  # closed, its loss not yet handled: never join it; dial afresh
        if session is not None and session.engine is not None:
            if not self._incarnation(req, session, session.engine, welcome=False):
                return  # failed, re-resolved elsewhere, or waiting for the old link's cut
        if session is None:  # dialled once this request is bound (decode_dials)
            session = self._dials.dial(req.peer, req.record.engine)
        with self._transition():
            req.session = session
            session.requests.add(req.id)
            if session.ready:
                self._apply(req, req.life.on_link_ready(self._progress.clock.now()))
            else:
                session.waiting.append(req)

    def _on_notify(self, sender: str, payload: bytes) -> None:
        """Transport thread: one transfer of some request landed. Queued; never blocks.

        The progress thread applies every payload queued meanwhile under one
        hold of the table lock (`_apply_landed`, #23): the transport's thread
        goes straight back to moving bytes and never takes the table lock, so
        it is not handed back and forth between it, the progress thread and
        the callers, and a burst of notifies costs one wake-up and one lock.
        """
        self._landed.append((sender, payload))
        if not self._landing:
            self._landing = True
            self._progress.call(self._apply_landed)

    def _apply_landed(self) -> None:
        """Progress thread: the queued notifies, decoded, then applied under one hold of the lock.

        A notify queued before a fence and applied after it finds its request
        Failed and is ignored (notifies count only while it may still receive).
        """
        self._landing = False  # first: a notify queued from now on schedules another turn
        msgs = []
        while self._landed:
            sender, payload = self._landed.popleft()
            try:
                msgs.append((sender, decode_notify(payload)))
            except ProtocolError as exc:
                log.warning("pdxfer decode: dropping a malformed notify from %s: %s", sender, exc)
        if not msgs:
            return
        now = self._progress.clock.now()
        with self._transition():
            for sender, msg in msgs:
                req = self._table.find(msg.request)
                if (not isinstance(req, DecodeRequest) or req.life.xid != msg.xid
                        or req.session is None or req.session.engine != sender):
                    continue  # stale (an earlier use of the id) or not from its prefill
                if req.life.phase in (DPhase.EXPECTED, DPhase.RECEIVING):
                    if req.wire_from is None:
                        req.wire_from = now
                    req.wire_to = now
                    req.nbytes += msg.nbytes
                    req.segments += msg.segments
                    req.transfers += 1
                    self._observer.event(req, "landed", ("chunk={} part={}/{} bytes={}", msg.chunk,
                                                         msg.part, msg.parts, msg.nbytes))
                self._apply(req, req.life.on_landed(msg.chunk, msg.part, msg.parts, msg.last, now,
                                                    msg.span, msg.lo, msg.hi))

    # -- control messages (progress thread) -----------------------------------------
    def _on_message(self, link: ControlConn, msg: Any) -> None:
        session: PrefillPeer = link.owner
        if isinstance(msg, Ping):
            return
        if not session.ready:
            if isinstance(msg, Welcome):
                self._on_welcome(session, msg)
            elif isinstance(msg, Refuse):
                session.refusal = (msg.kind, msg.reason)
                self._observer.on_link("refused", str(msg.kind)[:32])
                log.warning("pdxfer decode: prefill at %s refused the handshake (%s): %s",
                            session.addr, msg.kind, msg.reason)
                self._dials.doom(session)
                link.close(f"prefill at {session.addr} refused the handshake: {msg.reason}")
            else:
                link.refuse(f"expected welcome or refuse, got {type(msg).TYPE!r}")
            return
        if not isinstance(msg, (Abort, AbortAck)):
            return link.refuse(f"a decode does not accept {type(msg).TYPE!r} messages")
        try:
            links = check_links(msg.links, f"{type(msg).TYPE} of request {msg.request!r:.80}")
        except ProtocolError as exc:
            return link.refuse(str(exc))
        with self._transition():
            req = self._table.find(msg.request)
            if not isinstance(req, DecodeRequest) or req.life.xid != msg.xid or req.session is not session:
                return
            self._observer.event(req, "received", type(msg).TYPE)
            life = req.life
            self._apply(req, life.on_abort_ack(msg.clean, links) if isinstance(msg, AbortAck)
                        else life.on_peer_abort(msg.reason, msg.fence, links))

    def _on_welcome(self, session: PrefillPeer, msg: Welcome) -> None:
        assert session.link is not None
        try:
            reason = welcome_mismatch(self._pools, msg)
        except ProtocolError as exc:
            return session.link.refuse(str(exc))
        if reason is not None:
            session.refusal = ("layout", reason)
            self._observer.on_link("refused", "layout")
            log.warning("pdxfer decode: refused prefill at %s: %s", session.addr, reason)
            self._dials.doom(session)
            return session.link.close(f"layout mismatch with prefill at {session.addr}")
        waiting, session.waiting = session.waiting, []
        keep = [req for req in waiting if self._incarnation(req, session, msg.engine, welcome=True)]
        if not keep and session.expected not in (None, msg.engine):
            return session.link.close(f"prefill at {session.addr} is engine {msg.engine}, not "
                                      f"{session.expected} as its record says: refused")
        session.waiting = keep
        session.engine = msg.engine
        session.ready = True
        self._observer.on_link("opened")
        self._dials.reached(session.addr)
        session.link.label = f"prefill {msg.engine} at {session.addr}"
        now = self._progress.clock.now()
        with self._transition():
            for req in session.waiting:
                try:  # one request's failure to go out must not stop the others' Expects
                    self._apply(req, req.life.on_link_ready(now))
                except Exception as exc:  # noqa: BLE001 — reported on that request, not lost
                    self._table.finish(req, False, f"expect could not be sent: {exc}", exc)
            session.waiting.clear()

    # -- incarnations (progress thread) ---------------------------------------------------
    def _incarnation(self, req: DecodeRequest, session: PrefillPeer, actual: str,
                     welcome: bool) -> bool:
        """May `req` use the link to engine `actual`? If not, it is re-resolved, requeued or failed.

        The record names the incarnation that should serve the request. When
        the link's engine differs, the directory is asked for the slot's
        record now: if it names `actual` at this address, the request's
        record was stale and is replaced by the fresh one; if it names another
        engine once (a successor elsewhere), the request is re-dialed there;
        if it confirms the record's engine on a link that is ready, that link
        is the old incarnation's: it is cut first, then the request dials.
        Anything else fails the request as peer lost (a stale record).
        """
        want = req.record.engine
        if want is None or want == actual:
            return True
        fresh = None
        if self._directory is not None and req.record.slot is not None:
            fresh = self._directory.resolve(req.record.slot)
        if fresh is not None and fresh.engine == actual and fresh.address == session.addr:
            return self._rebind(req, fresh, session, requeue=False)
        if fresh is not None and fresh.engine not in (want, actual) and not req.rebound:
            return self._rebind(req, fresh, session, requeue=True)
        if not welcome and fresh is not None and fresh.engine == want and session.link is not None:
            # The directory confirms the newer incarnation: the ready link is the old one.
            self._cut(session, f"prefill at {session.addr} was engine {actual}; the directory now "
                               f"names {want} there: dropping the old incarnation's link")
            self._start(req)  # dials afresh: the old session is gone
            return False
        why = (f"prefill at {session.addr} answers as engine {actual}, but the record for "
               f"{req.record.slot.path() if req.record.slot else session.addr} names {want}"
               f"{' and the directory has nothing newer' if self._directory is not None else ''}: "
               "a stale record (did the prefill restart?); resolve it again and retry")
        self._fail_unbound(req, session, why)
        return False

    def _rebind(self, req: DecodeRequest, fresh: PeerRecord, session: PrefillPeer,
                requeue: bool) -> bool:
        reason = self._refusal(fresh)
        if reason is not None:
            self._fail_unbound(req, session, str(layout_error(reason)), LayoutMismatchError(reason))
            return False
        log.info("pdxfer decode: request %r re-resolved to engine %s at %s", req.id, fresh.engine,
                 fresh.address)
        req.record, req.peer, req.rebound = fresh, fresh.address, True
        if requeue:
            if req.session is session:
                req.session = None
                session.requests.discard(req.id)
            self._progress.call(self._start, req)
            return False
        return True

    def _fail_waiting(self, session: PrefillPeer, reqs: list[DecodeRequest], reason: str,
                      error: BaseException) -> None:
        """`reqs`, waiting on `session` (never reached), fail as lost: off its waiting list, fenced if bound."""
        gone = {id(r) for r in reqs}
        with self._transition():  # fences, if any, run as it ends
            session.waiting = [r for r in session.waiting if id(r) not in gone]
            for r in reqs:
                self._apply(r, r.life.on_link_lost(reason, error))

    def _fail_unbound(self, req: DecodeRequest, session: PrefillPeer, why: str,
                      error: BaseException | None = None) -> None:
        """Fail a request no Expect was sent for (nothing can land): at once, no fence."""
        with self._transition():
            self._apply(req, req.life.on_link_lost(why, error or PeerLostError(why)))
        session.requests.discard(req.id)

    def _on_directory(self, event: Any) -> None:
        """Directory thread: a replaced prefill's links are cut on the progress thread."""
        if event.kind == "replaced" and event.old is not None and not self._closed:
            self._progress.call(self._on_replaced, event.old, event.record)

    def _on_replaced(self, old: PeerRecord, new: PeerRecord) -> None:
        """Cut every link to the old incarnation: its requests fail as peer lost, fenced if bound."""
        for session in list(self._sessions.values()):
            if session.link is None or session.link.closed:
                continue
            if session.engine == old.engine or (session.engine is None
                                                and session.expected == old.engine):
                self._cut(session, f"prefill {old.engine} at {session.addr} was replaced by "
                                   f"{new.engine} at {new.address} (directory)")

    def _cut(self, session: PrefillPeer, why: str) -> None:
        """Close `session`'s link and fail (fence) its requests now, not at the loop's next turn.

        Now, so that whatever is queued behind — a request to the new
        incarnation — dials only after the old one's requests are failed and
        fenced. The close's own queued `_link_lost` then finds nothing left.
        """
        assert session.link is not None
        session.link.close(why)
        self._link_lost(session.link, why)

    def _link_lost(self, link: ControlConn, reason: str) -> None:
        session: PrefillPeer = link.owner
        if self._closed:
            return  # close() fails the requests itself, after the transport is down
        if link.connecting:  # it never connected: nothing was lost
            if session.link is link:
                self._dials.not_reached(session, reason)
            return
        if self._sessions.get(session.addr) is session:
            del self._sessions[session.addr]  # the next request dials afresh
        if session.ready:
            self._observer.on_link("lost")
            self._dials.lost(session.addr)
        reason, error = why_lost(session.addr, session.refusal, reason, reached=session.ready)
        with self._transition():  # fences run as it ends, one drop_peer for the session
            reqs = session.waiting + [r for rid in session.requests
                                      if isinstance(r := self._table.find(rid), DecodeRequest)
                                      and r.session is session]
            session.waiting.clear()
            for r in reqs:
                self._apply(r, r.life.on_link_lost(reason, error))
            orphaned = any(r.life.phase is DPhase.ORPHANED for r in reqs)
        if orphaned and session.engine is not None:
            # Until its links settle: a prefill that has not noticed the loss could reconnect
            # and post a chunk of an orphan it still had queued, after settled() said True.
            self._transport.refuse_new_links(session.engine)

    # -- timers (progress thread) ----------------------------------------------------
    def _tick(self, now: float) -> float:
        cfg = self.config
        if self._dials is None:  # the constructor is still running
            return 0.001
        close, wake = self._dials.tick(now)  # first: a request never connected says so, not "timed out"
        with self._transition():  # the fences it asks for run as it ends, one per prefill
            for req in self._pop_due(now):  # only what is due: #29.6
                self._apply(req, req.life.on_tick(now, req.peer))
            due = self._due[0][0] - now if self._due else math.inf
            held = list(self._settling.values())
            orphans = [(r, r.session.engine) for r in held
                       if r.life.phase is DPhase.ORPHANED and r.session is not None]
            settling = [(r, r.session.engine, r.life.links) for r in held
                        if r.life.phase is DPhase.QUARANTINED and r.life.links and r.session is not None]
        # Asked of the transport, off the lock: nothing of these links can land any more (#25.1).
        settled = self._transport.settled
        gone = [r for r, engine in orphans if engine is None or settled(engine)]
        quiet = [r for r, engine, links in settling
                 if engine is not None and all(settled(engine, name or None) for name in links)]
        if gone or quiet:
            with self._transition():
                for req in gone:
                    self._apply(req, req.life.on_peer_gone())
                for req in quiet:
                    self._apply(req, req.life.on_quiet())
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
        renew = self._renew(now)
        # Asking the transport is polling: 5 ms while something waits on it; else the next deadline.
        return 0.005 if settling or orphans else min(0.1, cfg.heartbeat / 2, wake, due, renew)

    # -- close ----------------------------------------------------------------
    def _shutdown(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._run_on_progress(self._shutdown_on_thread, self.config.shutdown_wait)
        self._dials.close(self.config.shutdown_wait)

    def _shutdown_on_thread(self) -> None:
        with self._transition():
            for req in self._table.running():
                session = req.session
                if (req.life.phase in (DPhase.EXPECTED, DPhase.RECEIVING, DPhase.ABORTING)
                        and session is not None and session.link is not None):
                    self._defer(session.link.send,
                                Abort(req.id, req.life.xid, "decode engine closed", False))
        for session in list(self._sessions.values()):
            if session.link is not None:
                session.link.close("decode engine closed")
