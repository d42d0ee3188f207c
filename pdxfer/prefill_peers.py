"""The prefill's peers: accepting decodes, their handshake, and their data connections.

A mixin of `PrefillEngine`, split off so the engine module stays the
request driver. It owns the per-peer half of the prefill: accepting control
links, answering a Hello (`handshake.hello_routes`), and keeping each
decode's data connection open — opened by `handshake.DataLinks` workers
(the Welcome goes out once it is warm), cut or reopened after a fence, a cut
or a loss, always with the lost transfers' requests told first
(`PrefillLife.on_link_cut`) and finished only after the close returned —
and, at close(), draining and closing all of them.

It reads the engine's `_lock`, `_table`, `_sessions`, `_links`, `_data`,
`_progress`, `_pools`, `config` and `engine_id`, and calls its `_apply`.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from typing import Any

from pdxfer.transport.errors import ProtocolError, TransportError
from pdxfer.transport.listener import ACCEPT_BACKOFF, AcceptBackoff

from .chunks import DecodePeer, PrefillRequest, unfinished
from .errors import ClosedError
from .handshake import Refusal, hello_routes
from .protocol import Hello, Refuse, Welcome
from .session import MAX_PENDING, ControlConn, format_address

log = logging.getLogger("pdxfer")


class DecodePeers:
    """Peer management for `PrefillEngine` (see the module docstring for what it reads)."""

    _lock: Any
    _table: Any
    _sessions: dict[str, DecodePeer]
    _links: set[ControlConn]
    _data: Any
    _progress: Any
    _pools: Any
    _listener: Any
    config: Any
    engine_id: str
    _refused_pending = 0  # connections closed at accept for MAX_PENDING (log throttle)
    # ... and calls the engine's `_apply`, `_on_message` and `_run_on_progress` (no stubs here:
    # this class precedes `Engine` in the MRO, so a stub would shadow the real method).

    # -- data connections (lock held unless said otherwise) --------------------------------
    def _reopen(self, session: DecodePeer) -> None:
        """Start reopening a peer's dead or missing data connection (once). Lock held."""
        if not session.opening and not session.ready and not session.link.closed:
            self._cut(session, f"data connection to decode {session.engine} lost", fenced=False)

    def _cut(self, session: DecodePeer | None, reason: str, *, fenced: bool, reopen: bool = True) -> None:
        """Close the peer's data connection (on a worker), failing what was in flight on it; reopen."""
        if session is None:
            return
        now, affected = self._progress.clock.now(), []
        for rid in list(session.requests):
            req = self._table.find(rid)
            if isinstance(req, PrefillRequest) and req.session is session and not req.finished:
                self._apply(req, req.life.on_link_cut(reason, now, bool(unfinished(req.handles)),
                                                      fenced=fenced))
                if req.life.cutting:
                    affected.append(req)
        old, session.conn = session.conn, None
        session.epoch += 1
        session.opening = reopen and not session.link.closed
        after = (session, session.epoch, affected)
        if old is not None:
            self._data.retire(old, lambda: self._progress.call(self._after_cut, *after))
        else:
            self._after_cut(*after, locked=True)

    def _after_cut(self, session: DecodePeer, epoch: int, affected: list, locked: bool = False) -> None:
        if not locked:
            with self._transition():
                return self._after_cut(session, epoch, affected, True)
        for req in affected:
            self._apply(req, req.life.on_cut_done(bool(unfinished(req.handles))))
        if session.opening and epoch == session.epoch:
            self._data.open(session, epoch)

    def _on_data_ready(self, session: DecodePeer, epoch: int, conn: Any) -> None:
        with self._transition():
            if epoch != session.epoch or session.link.closed or self._closed:
                return
            session.conn, session.opening = conn, False
            if not session.welcomed:
                session.welcomed = True
                self._defer(session.link.send,
                            Welcome(self.engine_id, self._pools.descs, self._pools.fingerprints))
            now = self._progress.clock.now()
            for rid in list(session.requests):
                req = self._table.find(rid)
                if isinstance(req, PrefillRequest) and req.session is session:
                    self._apply(req, req.life.on_link_ready(now))

    def _on_data_failed(self, session: DecodePeer, epoch: int, exc: BaseException) -> None:
        what = ("cannot reach" if isinstance(exc, (TransportError, OSError))
                else f"failed opening ({type(exc).__name__}) a data connection to")
        reason = f"prefill {what} the decode's {self.config.transport} endpoint {session.address!r}: {exc}"
        with self._transition():
            if epoch != session.epoch or session.link.closed:
                return
            session.opening = False
            if session.welcomed:  # the requests waiting for it fail; the next send retries
                for rid in list(session.requests):
                    req = self._table.find(rid)
                    if isinstance(req, PrefillRequest) and req.session is session:
                        self._apply(req, req.life.on_post_failed(reason, exc, self._progress.clock.now(), False))
                return
        self._refuse(session.link, "transport", reason)

    # -- control links (progress thread) ---------------------------------------------
    _accepting_backoff: AcceptBackoff | None = None

    @property
    def _accepting(self) -> AcceptBackoff:
        if self._accepting_backoff is None:
            self._accepting_backoff = AcceptBackoff("pdxfer prefill listener")
        return self._accepting_backoff

    def _pause_accepting(self, listener: Any) -> None:
        """Out of fds: the failed connection stays queued and the level-triggered selector would
        report it again at once (a spinning core). Stop watching the listener for
        `ACCEPT_BACKOFF` s; every other link is served meanwhile. Progress thread.
        """
        try:
            self._progress.selector.unregister(listener)
        except (KeyError, ValueError):
            return

        def resume() -> None:
            if self._listener is listener and listener.fileno() >= 0:
                try:
                    self._progress.selector.register(listener, selectors.EVENT_READ, self._on_accept)
                except (KeyError, ValueError, OSError):
                    pass  # closed or registered again meanwhile

        timer = threading.Timer(ACCEPT_BACKOFF, self._progress.call, (resume,))
        timer.daemon = True
        timer.start()

    def _on_accept(self, _mask: int) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, peer = listener.accept()
            except OSError as exc:  # nothing more to accept now (or a transient failure)
                if self._accepting.failed(exc):
                    self._pause_accepting(listener)
                return
            self._accepting.accepted()
            if sum(1 for link in self._links if not link.handshaken) >= MAX_PENDING:
                self._refused_pending += 1
                if self._refused_pending & (self._refused_pending - 1) == 0:  # 1st, 2nd, 4th, ...
                    log.warning("pdxfer: %d connections refused at accept: %d are already "
                                "waiting to say Hello", self._refused_pending, MAX_PENDING)
                sock.close()
                continue
            self._links.add(ControlConn(sock, self._progress, f"decode at {format_address(peer[0], peer[1])}",
                                 self._on_message,
                                 self._link_lost,
                                 accepted=True))

    def _on_hello(self, link: ControlConn, msg: Hello) -> None:
        try:
            routes = hello_routes(self._pools, self.config.transport, msg)
        except Refusal as exc:
            return self._refuse(link, exc.kind, exc.reason)
        except ProtocolError as exc:
            return link.refuse(str(exc))
        old = self._sessions.get(msg.engine)
        if old is not None:
            old.link.close("replaced by a new control link from the same decode engine")
        link.handshaken = True  # its frames may now be as large as the protocol allows
        session = DecodePeer(link, msg.engine, msg.address, routes)
        self._sessions[msg.engine] = link.owner = session
        link.label = f"decode {msg.engine}"
        with self._transition():
            self._reopen(session)  # the Welcome goes out once the data connection is warm

    def _refuse(self, link: ControlConn, kind: str, reason: str) -> None:
        """Refuse a decode's handshake, logged; keep its link to hear which requests that dooms.

        The decode answers a `Refuse` with an `Abort` per request it was about
        to expect, then hangs up: that is how a prefill's sender learns of a
        refusal at once instead of waiting out `request_timeout` (#18). The
        link stays a stranger's (small frames, `connect_timeout` to hang up,
        `Engine._watch`) and its owner becomes the `Refusal`.
        """
        log.warning("pdxfer prefill: refused %s (%s): %s", link.label, kind, reason)
        session = link.owner
        if isinstance(session, DecodePeer) and self._sessions.get(session.engine) is session:
            del self._sessions[session.engine]  # never welcomed: nothing of it to cut
        link.owner = Refusal(kind, reason)
        link.handshaken = False
        link.opened = self._progress.clock.now()  # its connect_timeout to hang up runs from the refusal
        link.send(Refuse(kind, reason))

    def _link_lost(self, link: ControlConn, reason: str) -> None:
        self._links.discard(link)
        session = link.owner
        if not isinstance(session, DecodePeer):  # a stranger, or a refused decode
            return
        why = f"decode engine {session.engine} lost: {reason}"
        now = self._progress.clock.now()
        with self._transition():
            if self._sessions.get(session.engine) is session:
                del self._sessions[session.engine]
            for rid in list(session.requests):
                req = self._table.find(rid)
                if isinstance(req, PrefillRequest) and req.session is session:
                    self._apply(req, req.life.on_link_lost(why, now, bool(unfinished(req.handles))))
            self._cut(session, why, fenced=False, reopen=False)

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
        self._run_on_progress(self._shutdown_on_thread, self.config.shutdown_wait)

    def _join_workers(self) -> None:
        self._data.close(self.config.shutdown_wait)

    def _shutdown_on_thread(self) -> None:
        with self._transition():
            closing = [s.conn for s in self._sessions.values() if s.conn is not None]
            for s in self._sessions.values():
                s.conn, s.epoch = None, s.epoch + 1
        for conn in closing:
            conn.close()
        reason = "prefill engine closed"
        with self._transition():
            for req in self._table.running():
                self._apply(req, req.life.on_close(reason, ClosedError(reason)))
        for link in list(self._links):
            link.close(reason)
        if self._listener is not None:
            try:
                self._progress.selector.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()
