"""The prefill side: listens for decode engines and pushes each request's cache to them.

A serving worker calls `send(request_id, {pool: src_indices})` once its
forward pass wrote the cache (or once per chunk, `last=False` until the
final one). The engine pairs that with the decode's `Expect` — whichever
arrives second triggers the post — maps the chunk's sources onto the next
positions of the decode's destination list (a cursor per pool), plans one
segment table per pool with the layout planner, and posts one transfer per
pool, each carrying a `Landed` notify. Decode answers `Done` once every part
of every chunk landed, and that is when the request is Success here: the
caller may reuse its source entries.

A failing request (local abort, decode's abort, a dead decode, a timeout)
is not reported Failed while its transfers may still read source memory:
it waits up to the abort grace for them, then cuts the data connection to
that decode, and only then finishes — telling the decode whether bytes may
still have been in flight (`fence`), so the decode knows whether to fence
before it reuses its entries.

Records created by a decode's `Expect` that the local caller never touched
are forgotten when they fail, leaving a bounded tombstone so a late `send()`
for that id fails at once with the reason instead of waiting for an Expect
that will never come.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Mapping
from typing import Any

from pdxfer import layout
from pdxfer.transport.errors import PeerLostError, ProtocolError, TransportError

from .config import EngineConfig, KVPoll
from .engine import Engine
from .errors import ClosedError, LayoutError, RequestError
from .outbound import (
    INF,
    Chunk,
    DecodePeer,
    PrefillRequest,
    Tombstones,
    chunk_indices,
    overdue,
    plan_chunk,
    post_parts,
    unfinished,
)
from .pools import mismatch, peer_routes
from .protocol import (
    Abort,
    AbortAck,
    Done,
    Expect,
    Hello,
    Ping,
    Refuse,
    Welcome,
    unpack_indices,
)
from .requests import check_request_id
from .session import Link, format_address


class PrefillEngine(Engine):
    """The sending side. `bootstrap_address` is what decode engines connect to."""

    role = "prefill"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None) -> None:
        self._sessions: dict[str, DecodePeer] = {}
        self._links: set[Link] = set()
        self._failing: set[PrefillRequest] = set()
        self._tombstones = Tombstones()
        self._listener: socket.socket | None = None
        super().__init__(pools, config)
        cfg = self.config
        try:
            self._listener = socket.create_server((cfg.host, cfg.port), backlog=128,
                                                  family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
            self._listener.setblocking(False)
        except OSError as exc:
            self.close()
            raise TransportError(
                f"prefill cannot listen on {format_address(cfg.host, cfg.port)}: {exc}; "
                "pick another EngineConfig.port (0 picks a free one)"
            ) from exc
        self.bootstrap_address = format_address(cfg.host, self._listener.getsockname()[1])
        self._progress.call(self._progress.selector.register, self._listener,
                            selectors.EVENT_READ, self._on_accept)

    # -- the public calls ---------------------------------------------------------
    def send(self, request_id: str, indices: Mapping[str, Any], *, last: bool = True,
             checkpoint: bool = False) -> None:
        """Ship `indices` (source entries per pool) of a request, or queue them until decode expects it.

        Raises `RequestError`/`LayoutError` for bad input before anything moves;
        a send for a request that already failed is ignored (poll/wait report
        the failure); one after the last chunk, or after Success, is refused.
        """
        rid = check_request_id(request_id)
        chunk = Chunk(chunk_indices(self._pools, rid, indices), bool(last), bool(checkpoint))
        with self._lock:
            self._check_open()
            req = self._table.find(rid)
            if req is None:
                req = PrefillRequest(rid, time.monotonic() + self.config.timeout)
                req.local = True
                self._table.add(req)
                tomb = self._tombstones.pop(rid, None)
                if tomb is not None:
                    self._table.finish(req, False, tomb)
                    return
            else:
                assert isinstance(req, PrefillRequest)
                if req.state is KVPoll.Failed:
                    return
                if req.state is KVPoll.Success or req.last_sent:
                    raise RequestError(
                        f"request {rid!r} already sent its last chunk ({req.state.name}); a "
                        "duplicate send is refused — use a new id, or release() and resend"
                    )
                req.local = True
            if req.failing is not None:
                return
            if req.dst is None:
                for pool, src in chunk.indices.items():
                    layout.check_indices(self._pools.arenas[pool], src, what=f"pool {pool!r} source index")
                req.pending.append(chunk)
                req.last_sent = chunk.last
                if not req.pending[1:]:
                    req.deadline = time.monotonic() + self.config.timeout
                return
            self._post(req, chunk)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Give up on a request; the decode hears of it at once. Non-blocking."""
        rid = check_request_id(request_id)
        with self._lock:
            req = self._table.get(rid)
            assert isinstance(req, PrefillRequest)
            if req.finished:
                return
            self._fail(req, f"aborted by prefill: {reason}", None)
            if req.session is None and not req.handles:
                self._finalize(req, cut=False)

    # -- posting ----------------------------------------------------------------
    def _post(self, req: PrefillRequest, chunk: Chunk) -> None:
        """Plan the chunk, then post it; refusals raise before anything is posted. Lock held."""
        session = req.session
        assert session is not None
        parts = plan_chunk(req, chunk, self._pools)
        try:
            if session.conn is None:  # a fence or a cut killed the last one; no sticky failures
                session.conn = self._transport.connect(session.address)
            post_parts(req, parts, chunk.last, session.conn)
        except TransportError as exc:
            if isinstance(exc, (PeerLostError, ClosedError)):
                session.conn = None
            self._fail(req, f"posting to decode {session.engine} failed: {exc}", exc)
            return
        self._table.advance(req, KVPoll.Transferring)
        req.deadline = time.monotonic() + self.config.timeout if chunk.last else INF

    # -- failing ----------------------------------------------------------------
    def _fail(self, req: PrefillRequest, reason: str, error: BaseException | None) -> None:
        """Start failing `req`: it finishes once its transfers are done or cut. Lock held."""
        if req.finished or req.failing is not None:
            return
        req.failing = (reason, error)
        req.fail_by = time.monotonic() + self.config.grace
        self._failing.add(req)
        self._progress.tick_soon()

    def _fail_here(self, req: PrefillRequest, reason: str, error: BaseException | None) -> None:
        """`_fail`, finished at once when nothing is in flight. Progress thread, lock held."""
        self._fail(req, reason, error)
        if req.failing is not None and not req.finished and not unfinished(req.handles):
            self._finalize(req, cut=False)

    def _finalize(self, req: PrefillRequest, cut: bool) -> None:
        """Failed, told to the decode; `cut` if transfers were cut in flight. Lock held."""
        assert req.failing is not None
        reason, error = req.failing
        self._failing.discard(req)
        req.cut = req.cut or cut
        req.handles = []
        self._table.finish(req, False, reason, error)
        session = req.session
        if session is not None:
            session.requests.discard(req.id)
            if req.ack:
                session.link.send(AbortAck(req.id, req.xid, not req.cut))
            else:
                session.link.send(Abort(req.id, req.xid, reason, req.cut))
        if not req.local:
            self._table.forget(req)
            self._tombstones.add(req.id, reason)

    # -- control links (progress thread) ---------------------------------------------
    def _on_accept(self, _mask: int) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            label = f"decode at {format_address(peer[0], peer[1])}"
            self._links.add(Link(sock, self._progress, label, self._on_message,
                                 lambda link, why: self._progress.call(self._link_lost, link, why)))

    def _on_message(self, link: Link, msg: Any) -> None:
        if link.owner is None:
            if isinstance(msg, Hello):
                self._on_hello(link, msg)
            else:
                link.refuse(f"expected a hello first, got {type(msg).TYPE!r}")
            return
        if isinstance(msg, Expect):
            self._on_expect(link, msg)
        elif isinstance(msg, Done):
            self._on_done(link, msg)
        elif isinstance(msg, Abort):
            self._on_abort(link, msg)
        elif not isinstance(msg, Ping):
            link.refuse(f"a prefill does not accept {type(msg).TYPE!r} messages")

    def _on_hello(self, link: Link, msg: Hello) -> None:
        pools = self._pools
        if msg.transport != self.config.transport:
            return self._refuse(link, "transport", (
                f"decode uses transport {msg.transport!r}, this prefill {self.config.transport!r}; "
                "configure both with the same EngineConfig.transport"))
        try:
            reason = mismatch((pools.descs, pools.fingerprints), (msg.pools, msg.fingerprints))
            if reason is not None:
                return self._refuse(link, "layout", reason)
            routes = peer_routes(pools, msg.pools, msg.buffers, msg.regions)
        except (ProtocolError, AttributeError, TypeError, KeyError) as exc:
            return link.refuse(f"malformed hello: {exc}")
        try:
            conn = self._transport.connect(msg.address)
        except TransportError as exc:
            return self._refuse(link, "transport", (
                f"prefill cannot reach the decode's {self.config.transport} endpoint "
                f"{msg.address!r}: {exc}"))
        old = self._sessions.get(msg.engine)
        if old is not None:
            old.link.close("replaced by a new control link from the same decode engine")
        session = DecodePeer(link, msg.engine, msg.address, routes, conn)
        self._sessions[msg.engine] = link.owner = session
        link.label = f"decode {msg.engine}"
        link.send(Welcome(self.engine_id, pools.descs, pools.fingerprints))

    @staticmethod
    def _refuse(link: Link, kind: str, reason: str) -> None:
        link.send(Refuse(kind, reason))
        link.close(f"refused {link.label}: {reason}")

    def _on_expect(self, link: Link, msg: Expect) -> None:
        session: DecodePeer = link.owner
        rid, xid = msg.request, msg.xid
        try:
            if not rid:
                raise ProtocolError("expect with an empty request id")
            dst = {pool: unpack_indices(raw, f"expect {rid!r} pool {pool!r}")
                   for pool, raw in msg.indices.items()}
        except ProtocolError as exc:
            return link.refuse(str(exc))
        unknown = sorted(p for p in dst if p not in self._pools.arenas)
        with self._lock:
            if unknown or self._closed:
                why = f"prefill has no pool(s) {unknown}" if unknown else "prefill engine closing"
                return link.send(Abort(rid, xid, why, False))
            self._tombstones.pop(rid, None)
            req = self._table.find(rid)
            if req is None:
                req = PrefillRequest(rid, INF)
                self._table.add(req)
            elif req.session is not None or req.state is KVPoll.Success:
                return link.send(Abort(rid, xid, (
                    f"duplicate request id {rid!r}: this prefill already has it "
                    f"({req.state.name}); request ids must be unique per prefill"), False))
            elif req.state is KVPoll.Failed:
                return link.send(Abort(rid, xid, req.reason or "failed on prefill", False))
            assert isinstance(req, PrefillRequest)
            req.xid, req.session, req.peer, req.dst = xid, session, session.engine, dst
            req.cursor = dict.fromkeys(dst, 0)
            session.requests.add(rid)
            if req.failing is not None:
                return  # aborted locally before the Expect: the tick tells the decode
            self._table.advance(req, KVPoll.WaitingForInput)
            pending, req.pending = req.pending, []
            for chunk in pending:
                try:
                    self._post(req, chunk)
                except (RequestError, LayoutError) as exc:
                    self._fail(req, str(exc), exc)
                if req.failing is not None:
                    break

    def _on_done(self, link: Link, msg: Done) -> None:
        with self._lock:
            req = self._table.find(msg.request)
            if (not isinstance(req, PrefillRequest) or req.xid != msg.xid or req.finished
                    or req.session is not link.owner or req.failing is not None):
                return
            req.handles = []  # decode saw every notify: every byte is in its memory
            req.session.requests.discard(req.id)
            self._table.finish(req, True)

    def _on_abort(self, link: Link, msg: Abort) -> None:
        with self._lock:
            req = self._table.find(msg.request)
            if isinstance(req, PrefillRequest) and req.session is None and not req.finished:
                # Sent here but never expected: the decode gave up before its Expect went out.
                self._fail(req, msg.reason, None)
                self._finalize(req, cut=False)
                return
            if not isinstance(req, PrefillRequest) or req.xid != msg.xid or req.session is not link.owner:
                if req is None:
                    self._tombstones.add(msg.request, msg.reason)
                return link.send(AbortAck(msg.request, msg.xid, True))
            if req.finished:
                return link.send(AbortAck(req.id, req.xid, not req.cut))
            req.ack = True
            # Verbatim: the decode's reason already says who gave up and why.
            self._fail_here(req, msg.reason, None)

    def _link_lost(self, link: Link, reason: str) -> None:
        self._links.discard(link)
        session: DecodePeer | None = link.owner
        if session is None:
            return
        with self._lock:
            if self._sessions.get(session.engine) is session:
                del self._sessions[session.engine]
            for rid in list(session.requests):
                req = self._table.find(rid)
                if isinstance(req, PrefillRequest) and req.session is session and not req.finished:
                    self._fail_here(req, f"decode engine {session.engine} lost: {reason}",
                                    PeerLostError(reason))
            conn = self._cut(session)
        if conn is not None:
            conn.close()  # fails its in-flight writes now rather than at the grace

    def _cut(self, session: DecodePeer) -> Any:
        """Detach the session's data connection for closing (outside the lock). Lock held.

        Closing it cuts every transfer still in flight on it — not only the
        request that prompted the cut — and bytes already on the wire may
        still land, so every such request is marked `cut`: its decode is told
        to fence before it reuses the entries.
        """
        conn, session.conn = session.conn, None
        if conn is not None:
            for rid in session.requests:
                req = self._table.find(rid)
                if (isinstance(req, PrefillRequest) and req.session is session
                        and not req.finished and unfinished(req.handles)):
                    req.cut = True
        return conn

    # -- timers (progress thread) ------------------------------------------------------
    def _tick(self, now: float) -> float:
        cfg = self.config
        silent, cut = [], []
        with self._lock:
            for req in self._table.running():
                assert isinstance(req, PrefillRequest)
                why = overdue(req, now, cfg.timeout) if req.failing is None else None
                if why is not None:
                    self._fail(req, *why)
            for req in list(self._failing):
                if not unfinished(req.handles):
                    self._finalize(req, cut=False)
                elif now >= req.fail_by:
                    cut.append(req)
            for link in self._links:
                if now - link.last_rx > cfg.timeout:  # also a peer that never says hello
                    silent.append(link)
                elif link.owner is not None and now - link.last_tx >= cfg.heartbeat:
                    link.send(Ping())
            sessions = {id(r.session): r.session for r in cut if r.session is not None}
            closing = [c for c in map(self._cut, sessions.values()) if c is not None]
        for link in silent:
            link.close(f"{link.label} silent for {now - link.last_rx:.1f} s (timeout {cfg.timeout} s)")
        for conn in closing:
            conn.close()
        with self._lock:
            for req in cut:
                if req.failing is not None and not req.finished:
                    self._finalize(req, cut=True)
            return 0.005 if self._failing else min(0.1, cfg.heartbeat / 2)

    # -- close ----------------------------------------------------------------
    def _shutdown(self) -> None:
        # Let transfers already posted finish (bounded) rather than cutting them.
        until = time.monotonic() + self.config.grace
        with self._lock:
            handles = [h for r in self._table.running() for h in r.handles]
        for h in handles:
            try:
                h.wait(max(0.0, until - time.monotonic()))
            except TransportError:
                pass
        self._run_on_progress(self._shutdown_on_thread, 5.0)

    def _shutdown_on_thread(self) -> None:
        with self._lock:
            closing = [c for c in map(self._cut, self._sessions.values()) if c is not None]
        for conn in closing:
            conn.close()
        reason = "prefill engine closed"
        with self._lock:
            for req in self._table.running():
                assert isinstance(req, PrefillRequest)
                if req.failing is None:
                    req.failing = (reason, ClosedError(reason))
                self._finalize(req, cut=False)  # `req.cut` says if a close cut it
        for link in list(self._links):
            link.close("prefill engine closed")
        if self._listener is not None:
            try:
                self._progress.selector.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()
