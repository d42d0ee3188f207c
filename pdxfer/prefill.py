"""The prefill side: listens for decode engines and pushes each request's cache to them.

A serving worker calls `send(request_id, {pool: src_indices})` once its
forward pass wrote the cache (or once per chunk, `last=False` until the
final one); the decode's `Expect` names the destinations. What happens next
is decided by the request's `lifecycle.PrefillLife`; this module is its
driver: look the record up, apply one transition under the table lock, carry
out the effects (`Post` plans the chunk with `chunks` and posts it on a
connection that is already open and warmed, so posting never waits on the
network; `Send` goes to the progress thread; `Cut` closes a data connection
on a worker; `Finish` settles the table).

Data connections are opened by `handshake.DataLinks`, off every caller's
thread and never under the lock: on a decode's Hello (the Welcome goes out
once it is ready), and again after the decode fenced us (`Fenced`) or a
connection was cut or lost (`prefill_peers.DecodePeers`, a collaborator
with a narrow interface: it is handed the calls it needs, never this
engine). Until then a peer is not ready and chunks queue.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from pdxfer import layout
from pdxfer.transport.errors import ProtocolError, TransportError

from .chunks import (
    Chunk,
    DecodePeer,
    PrefillRequest,
    check_layer_range,
    chunk_indices,
    closed_links,
    commit_span,
    note_wire_end,
    plan_chunk,
    post_parts,
    span_of,
    transfer_error,
    unfinished,
)
from .clock import MONOTONIC, Clock
from .config import EngineConfig, KVPoll, RequestStats
from .echo import EchoServer
from .engine import Engine
from .errors import ClosedError, LayoutError, RequestError
from .handshake import Refusal
from .lifecycle import Cut, Finish, PrefillLife, Send, Timing
from .pools import pool_layers
from .prefill_peers import DecodePeers
from .protocol import (
    Abort,
    AbortAck,
    Done,
    Echo,
    Expect,
    Fenced,
    Hello,
    LiveRange,
    Ping,
    Renew,
    check_offsets,
    check_renew,
    unpack_indices,
)
from .requests import RequestOutcome, check_request_id
from .resizing import apply_live_range
from .session import ControlConn, format_address, listen


def _never_expected(req: Any) -> bool:
    """`release(keep=)`: a local request no decode's Expect had reached (its decode may come late)."""
    return isinstance(req, PrefillRequest) and req.life.local and not req.life.expected


def released_reason(rid: str, gone: RequestOutcome) -> str:
    """What a decode whose Expect came after the prefill released the request is told."""
    how = gone.state.name + (f": {gone.reason}" if gone.reason else "")
    return (f"prefill already released request {rid!r} ({how}) before this decode's Expect "
            "arrived; its KV is gone — recompute it, or raise the prefill's request_timeout "
            "(or renew its hold with DecodeEngine.hold) so it waits for this decode")


class PrefillEngine(Engine):
    """The sending side. `bootstrap_address` is what decode engines connect to."""

    role = "prefill"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None, *,
                 clock: Clock = MONOTONIC) -> None:
        self._sessions: dict[str, DecodePeer] = {}  # shared with `_peers`, which adds and drops
        self._links: set[ControlConn] = set()  # likewise: every control link, watched by `_tick`
        self._peers: DecodePeers | None = None  # made once the progress loop exists
        self._echo: EchoServer | None = None  # likewise
        super().__init__(pools, config, clock=clock)
        cfg = self.config
        self._timing = Timing(cfg.request_wait, cfg.grace)
        self._peers = DecodePeers(
            sessions=self._sessions, links=self._links, table=self._table,
            transport=self._transport, pools=self._pools, progress=self._progress, config=cfg,
            engine_id=self.engine_id, transition=self._transition, defer=self._defer,
            apply=self._apply,
            # looked up per message: a hook installed on the engine after construction
            # (the fault tests wrap `_on_message`) still sees every message
            on_message=lambda link, msg: self._on_message(link, msg),
            closed=lambda: self._closed, on_link=self._observer.on_link)
        # `pdxfer probe`'s data-path check (`Echo`): a write of its own pattern, off the pools.
        self._echo = EchoServer(self._transport, self._progress, cfg.connect_wait,
                                f"pdxfer-echo-{self.engine_id}")
        try:
            listener = listen(cfg.host, cfg.port, "prefill")
        except BaseException:
            self.close()
            raise
        self.bootstrap_address = format_address(cfg.host, listener.getsockname()[1])
        self._peers.serve(listener)

    # -- the public calls ---------------------------------------------------------
    def send(self, request_id: str, indices: Mapping[str, Any], *, last: bool = True,
             checkpoint: bool = False, ready: Any = None,
             layers: tuple[int, int] | None = None) -> None:
        """Ship `indices` (source entries per pool) of a request, or queue them until decode expects it.

        Raises `RequestError`/`LayoutError` for bad input before anything moves;
        a send for a request that already failed is ignored (poll/wait report
        the failure); one after the last chunk, or after Success, is refused.
        Never waits on the network: a peer still (re)connecting queues the chunk.
        `ready` (CUDA pools): the `torch.cuda.Event` or stream after which these
        entries are final; None records the caller's current stream now
        (`transport.streams` has the contract; host pools take None).

        `layers=(a, b)` (streamed sends, #33): ship only layers `a..b-1` of
        these entries — of each pool's own layers, `b <= ` the deepest field
        of the engine's pools (`depth`) — while the caller computes the rest;
        `ready` is then the event after those layers. The ranges of one set
        of entries name the same indices, run in order from layer 0 to
        `depth`, and say the same `last`/`checkpoint`; the entries count as
        sent (the next chunk fills the destinations after them; `last=True`
        finishes the request) with the range that reaches `depth`, and the
        decode is Success only once every layer of every entry landed. A
        range out of order, over other entries, or over a pool that cannot
        ship layers (page-major) is refused by name before anything moves.
        """
        rid = check_request_id(request_id)
        chunk = Chunk(chunk_indices(self._pools, rid, indices), bool(last), bool(checkpoint),
                      self._pools.readiness(ready),
                      check_layer_range(rid, layers, self._pools.depth))
        now = self._progress.clock.now()
        with self._transition():
            self._check_open()
            req = self._table.find(rid)
            checked = False
            if req is None:
                tomb = self._table.tombstones.get(rid)
                if tomb is None:  # checked before the record exists: refused leaves nothing
                    span_of(rid, None, 0, chunk, self._pools.depth)
                    self._check_sources(chunk)
                    checked = True
                req = PrefillRequest(rid, PrefillLife(rid, self._timing, now, local=True))
                self._table.tombstones.pop(rid)
                self._table.released.pop(rid)  # a new use of a released id: expected anew
                self._table.add(req)
                if tomb is not None:  # the decode gave up on it before the caller got here
                    return self._apply(req, req.life.on_abort(tomb.reason or "failed", now, False))
            life, session = req.life, req.session
            if not life.check_send(chunk.last):
                return
            span_of(rid, req.stream, req.spans, chunk, self._pools.depth)  # refusals change nothing
            ready = session is not None and session.ready
            if life.posts_now(ready):
                chunk.parts = plan_chunk(req, chunk, self._pools)  # refusals raise here, before any change
            elif not checked:
                self._check_sources(chunk)
            self._observer.event(req, "send", ("last={}", chunk.last))
            self._apply(req, life.on_send(chunk, chunk.last, ready, now))
            commit_span(req, chunk, bool(last))
            req.sources.append(chunk.indices)  # in flight until the request finishes (resize)
            if session is not None and not ready:
                self._peers.reopen(session)

    def _control_links(self) -> list[Any]:
        return list(self._links)

    def _links_up(self) -> int:
        return len(self._sessions)

    def peers(self) -> list[DecodePeer]:
        """The decode engines connected now, one `chunks.DecodePeer` each (benches, diagnostics).

        The engine's own objects: read them; what the progress thread changes
        in them may change under the reader.
        """
        return list(self._sessions.values())

    def release(self, request_id: str) -> RequestOutcome:
        """Forget a finished request; an Expect for it that arrives later fails at once.

        Only a request no decode had expected yet is remembered so (bounded,
        `requests.Tombstones`): its decode may still be queued, and its Expect
        would otherwise be taken as a new use of the id and fail one
        `request_timeout` later (#30.5, #31.3). A `send()` of the id starts a
        new use and clears the mark; an Expect for a reused id must therefore
        come after that `send()`, or the id be fresh.
        """
        return self._table.release(check_request_id(request_id), keep=_never_expected)

    def _check_sources(self, chunk: Chunk) -> None:
        """Refuse source indices outside their pools, and layer ranges a pool cannot ship:
        what a queued chunk is checked by."""
        for pool, src in chunk.indices.items():
            arena = self._pools.arenas[pool]
            layout.check_indices(arena, src, what=f"pool {pool!r} source index")
            if chunk.layers is not None:
                pool_layers(pool, arena, chunk.layers)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Give up on a request; the decode hears of it at once. Non-blocking."""
        rid = check_request_id(request_id)
        with self._transition():
            req = self._table.get(rid)
            self._apply(req, req.life.on_abort(f"aborted by prefill: {reason}", self._progress.clock.now(),
                                               bool(unfinished(req.handles))))

    # -- effects (inside `_transition()`) ----------------------------------------------
    def _apply(self, req: PrefillRequest, effects: list, via: DecodePeer | None = None) -> None:
        """Carry out a transition's effects in order, then mirror the state into the table.

        Local work now (the table, planning and posting on a warm connection,
        a cut handed to a worker); a control message once the lock is released.
        """
        for eff in effects:
            if isinstance(eff, Finish):
                self._table.finish(req, eff.ok, eff.reason, eff.error)
                req.handles = []
                if req.session is not None:
                    req.session.requests.discard(req.id)
                if not req.life.local:
                    self._table.bury(req)  # pollable as Failed with its reason, bounded
            elif isinstance(eff, Send):
                msg = eff.msg
                if isinstance(msg, (Abort, AbortAck)) and req.links:
                    # the decode must see these settle before it frees the entries (#25.1)
                    msg = dataclasses.replace(msg, links=closed_links(req))
                session = via or req.session
                if session is not None:  # once the lock is released, on the progress thread
                    self._observer.event(req, "sent", type(msg).TYPE)
                    self._defer(session.link.send, msg)
            elif isinstance(eff, Cut):
                self._peers.cut(req.session, f"transfers to decode still running {self.config.grace} s "
                          "after the request failed; cut them", fenced=False)
            else:
                self._post(req, eff.chunk)
        self._table.advance(req, req.life.poll)

    def _post(self, req: PrefillRequest, chunk: Chunk) -> None:
        session = req.session
        assert session is not None and session.conn is not None
        now = self._progress.clock.now()
        try:
            parts = chunk.parts if chunk.parts is not None else plan_chunk(req, chunk, self._pools)
            post_parts(req, parts, chunk.last, session.conn, chunk.ready, self._observer.event,
                       (chunk.span, *(chunk.layers or (0, 0))))
        except (RequestError, LayoutError, TransportError) as exc:
            where = "" if isinstance(exc, (RequestError, LayoutError)) else f"posting to decode {session.engine} failed: "
            self._apply(req, req.life.on_post_failed(f"{where}{exc}", exc, now, bool(unfinished(req.handles))))

    # -- control links (progress thread) ---------------------------------------------
    def _on_message(self, link: ControlConn, msg: Any) -> None:
        session = link.owner
        if session is None:
            if isinstance(msg, Hello):
                return self._peers.hello(link, msg)
            return link.refuse(f"expected a hello first, got {type(msg).TYPE!r}")
        if isinstance(session, Refusal):  # a refused decode names the requests that dooms
            if not isinstance(msg, (Abort, Ping)):
                link.refuse(f"refused ({session.reason}); expected only its aborts, got {type(msg).TYPE!r}")
            if not isinstance(msg, Abort):
                return
            session = None
        if isinstance(msg, Expect):
            return self._on_expect(session, msg)
        if isinstance(msg, LiveRange):  # the decode moved a pool boundary (resizing)
            try:
                with self._transition():
                    return apply_live_range(session.routes, msg)
            except ProtocolError as exc:
                return link.refuse(str(exc))
        if isinstance(msg, Fenced):
            with self._transition():
                return self._peers.cut(session, f"decode {session.engine} fenced this prefill", fenced=True)
        if isinstance(msg, Renew):
            return self._on_renew(link, msg)
        if isinstance(msg, Echo):
            return self._echo.answer(session, msg)
        if not isinstance(msg, (Done, Abort)):
            if not isinstance(msg, Ping):
                link.refuse(f"a prefill does not accept {type(msg).TYPE!r} messages")
            return
        now = self._progress.clock.now()
        with self._transition():
            req = self._table.find(msg.request)
            if isinstance(msg, Abort) and req is None:  # nothing here yet: remember why
                self._table.tombstones.add(msg.request, RequestOutcome(
                    KVPoll.Failed, msg.reason, None, RequestStats(0, 0, 0, 0.0)))
            ours = (session is not None and isinstance(req, PrefillRequest)
                    and req.life.xid == msg.xid and req.session is session)
            if ours:
                self._observer.event(req, "received", type(msg).TYPE)
            if isinstance(msg, Done):
                if ours:
                    note_wire_end(req)
                    req.handles = []  # decode saw every notify: every byte is in its memory
                    self._apply(req, req.life.on_done())
            elif ours or (isinstance(req, PrefillRequest) and not req.life.expected):
                self._apply(req, req.life.on_peer_abort(msg.reason, now, bool(unfinished(req.handles))),
                            via=session)
            elif session is not None:
                self._defer(session.link.send, AbortAck(msg.request, msg.xid, True))

    def _on_renew(self, link: ControlConn, msg: Renew) -> None:
        """The decode still has these queued: renew each sent request's wait for its Expect."""
        try:
            rids = check_renew(msg.requests)
        except ProtocolError as exc:
            return link.refuse(str(exc))
        now = self._progress.clock.now()
        with self._transition():
            for rid in rids:
                req = self._table.find(rid)
                if isinstance(req, PrefillRequest):
                    self._apply(req, req.life.on_renew(now))

    def _on_expect(self, session: DecodePeer, msg: Expect) -> None:
        rid, xid = msg.request, msg.xid
        try:
            check_request_id(rid)
            dst = {pool: unpack_indices(raw, f"expect {rid!r:.80} pool {pool!r}")
                   for pool, raw in msg.indices.items()}
            skip = dict(check_offsets(msg.offsets, dst, f"expect {rid!r:.80}"))
        except (ProtocolError, RequestError) as exc:
            return session.link.refuse(str(exc))
        unknown = sorted(p for p in dst if p not in self._pools.arenas)
        now = self._progress.clock.now()
        with self._transition():
            if unknown or self._closed:
                why = f"prefill has no pool(s) {unknown}" if unknown else "prefill engine closing"
                return self._defer(session.link.send, Abort(rid, xid, why, False))
            req = self._table.find(rid)
            gone = self._table.released.get(rid) if req is None else None
            if gone is not None:  # a late Expect: the caller released it unexpected
                return self._defer(session.link.send, Abort(rid, xid, released_reason(rid, gone), False))
            self._table.tombstones.pop(rid)  # a new use of the id
            if req is None:
                req = PrefillRequest(rid, PrefillLife(rid, self._timing, now, local=False))
                self._table.add(req)
            life = req.life
            self._observer.event(req, "expect", ("decode={} xid={}", session.engine, xid))
            if not life.expected and not life.finished:
                req.session, req.peer, req.dst = session, session.engine, dst
                req.cursor = dict.fromkeys(dst, 0)
                req.skip = skip
                session.requests.add(rid)
            self._apply(req, life.on_expect(xid, session.ready, now, bool(unfinished(req.handles))),
                        via=session)
            if req.session is session and not session.ready:
                self._peers.reopen(session)

    # -- timers (progress thread) ------------------------------------------------------
    def _tick(self, now: float) -> float:
        cfg = self.config
        failing = False
        with self._transition():
            for req in self._table.running():
                err = transfer_error(req)
                if err is not None:
                    self._apply(req, req.life.on_transfer_failed(f"transfer to decode failed: {err}",
                                                                 err, now))
                self._apply(req, req.life.on_tick(now, bool(unfinished(req.handles))))
                failing = failing or req.life.failing is not None
        silent = self._watch(self._links, now, lambda link: isinstance(link.owner, DecodePeer))
        self._close_links(silent)
        return 0.005 if failing else min(0.1, cfg.heartbeat / 2)

    # -- close ----------------------------------------------------------------
    def _shutdown(self) -> None:
        # Let transfers already posted finish (bounded) rather than cutting them.
        until = time.monotonic() + self.config.grace
        with self._transition():
            handles = [h for r in self._table.running() for h in r.handles]
        for h in handles:
            try:
                h.wait(max(0.0, until - time.monotonic()))
            except TransportError:
                pass
        if self._peers is not None:
            self._run_on_progress(self._shutdown_on_thread, self.config.shutdown_wait)

    def _join_workers(self) -> None:
        if self._peers is not None:
            self._peers.join(self.config.shutdown_wait)
        if self._echo is not None:
            self._echo.close(self.config.shutdown_wait)

    def _shutdown_on_thread(self) -> None:
        assert self._peers is not None
        self._peers.close_data()
        reason = "prefill engine closed"
        with self._transition():
            for req in self._table.running():
                self._apply(req, req.life.on_close(reason, ClosedError(reason)))
        self._peers.close_links(reason)
