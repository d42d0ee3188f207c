"""The prefill's peers: accepting decodes, their handshake, and their data connections.

A collaborator of `PrefillEngine` (`DecodePeers`), split off so the engine
module stays the request driver, and handed only what it needs (#29: a
narrow interface, not the engine's private fields — as `decode_dials.Dials`
is for the decode). It owns the per-peer half of the prefill: accepting
control links (backing off when out of descriptors), answering a Hello
(`handshake.hello_routes`), and keeping each decode's data connection open —
opened by `handshake.DataLinks` workers (the Welcome goes out once it is
warm), cut or reopened after a fence, a cut or a loss, always with the lost
transfers' requests told first (`PrefillLife.on_link_cut`) and finished only
after the close returned — and, at close(), closing all of them.

What it is given: the engine's peer table (`sessions`, by engine id) and its
set of control links (`links`), both shared (the engine reads them for
`peers()` and its liveness watch); the request table (to find a peer's
requests); the transport (for `DataLinks`); the pools (Hello checks, the
Welcome); the progress loop; the config and the engine id; and four calls of
the engine's: `transition()` (the only way request state changes: lock held
inside, effects after), `defer(fn, *args)` (run once that lock is released),
`apply(req, effects, via)` (a request's transition effects, inside
`transition()`), `on_message(link, msg)` (the engine's control handler,
looked up per message), and `closed()`.
"""

from __future__ import annotations

import logging
import selectors
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pdxfer.transport.errors import ProtocolError, TransportError
from pdxfer.transport.listener import ACCEPT_BACKOFF, AcceptBackoff

from .chunks import DecodePeer, PrefillRequest, unfinished
from .handshake import DataLinks, Refusal, hello_routes
from .protocol import Hello, Refuse, Welcome
from .session import MAX_PENDING, ControlConn, format_address

log = logging.getLogger("pdxfer")


class DecodePeers:
    """Peer management for `PrefillEngine` (see the module docstring for what it is given)."""

    def __init__(self, *, sessions: dict[str, DecodePeer], links: set[ControlConn], table: Any,
                 transport: Any, pools: Any, progress: Any, config: Any, engine_id: str,
                 transition: Callable[[], AbstractContextManager[None]],
                 defer: Callable[..., None],
                 apply: Callable[..., None],
                 on_message: Callable[[ControlConn, Any], None],
                 closed: Callable[[], bool],
                 on_link: Callable[..., None] = lambda event, kind="": None) -> None:
        self._sessions = sessions
        self._on_link = on_link  # told "opened", "refused" (kind), "lost": the metrics
        self._links = links
        self._table = table
        self._pools = pools
        self._progress = progress
        self.config = config
        self.engine_id = engine_id
        self._transition = transition
        self._defer = defer
        self._apply = apply
        self._on_message = on_message
        self._is_closed = closed
        self._listener: Any = None
        self._accepting = AcceptBackoff("pdxfer prefill listener")
        self._refused_pending = 0  # connections closed at accept for MAX_PENDING (log throttle)
        call = progress.call
        self._data = DataLinks(transport, config.connect_wait, f"pdxfer-dial-{engine_id}",
                               lambda *a: call(self._on_data_ready, *a),
                               lambda *a: call(self._on_data_failed, *a))

    def serve(self, listener: Any) -> None:
        """Accept decodes on `listener` (bound, listening) from now on; it is ours to close."""
        self._listener = listener
        self._progress.call(self._progress.selector.register, listener, selectors.EVENT_READ,
                            self._on_accept)

    # -- data connections (inside the engine's `transition()` unless said otherwise) ---------
    def reopen(self, session: DecodePeer) -> None:
        """Start reopening a peer's dead or missing data connection (once). Lock held."""
        if not session.opening and not session.ready and not session.link.closed:
            self.cut(session, f"data connection to decode {session.engine} lost", fenced=False)

    def cut(self, session: DecodePeer | None, reason: str, *, fenced: bool, reopen: bool = True) -> None:
        """Close the peer's data connection (on a worker), failing what was in flight on it; reopen.

        Lock held (inside `transition()`).
        """
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
            if epoch != session.epoch or session.link.closed or self._is_closed():
                return
            session.conn, session.opening = conn, False
            if not session.welcomed:
                session.welcomed = True
                self._on_link("opened")
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

    def hello(self, link: ControlConn, msg: Hello) -> None:
        """A stranger's Hello: refuse it, or make it a peer and open its data connection."""
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
            self.reopen(session)  # the Welcome goes out once the data connection is warm

    def _refuse(self, link: ControlConn, kind: str, reason: str) -> None:
        """Refuse a decode's handshake, logged; keep its link to hear which requests that dooms.

        The decode answers a `Refuse` with an `Abort` per request it was about
        to expect, then hangs up: that is how a prefill's sender learns of a
        refusal at once instead of waiting out `request_timeout` (#18). The
        link stays a stranger's (small frames, `connect_timeout` to hang up,
        `Engine._watch`) and its owner becomes the `Refusal`.
        """
        log.warning("pdxfer prefill: refused %s (%s): %s", link.label, kind, reason)
        self._on_link("refused", kind)
        session = link.owner
        if isinstance(session, DecodePeer) and self._sessions.get(session.engine) is session:
            del self._sessions[session.engine]  # never welcomed: nothing of it to cut
        link.owner = Refusal(kind, reason)
        link.handshaken = False
        link.opened = self._progress.clock.now()  # its connect_timeout to hang up runs from the refusal
        # Who refused and its pools: the decode (or `pdxfer probe`) can name every difference.
        link.send(Refuse(kind, reason, self.engine_id, self.config.transport, self._pools.descs,
                         self._pools.fingerprints))

    def _link_lost(self, link: ControlConn, reason: str) -> None:
        self._links.discard(link)
        session = link.owner
        if not isinstance(session, DecodePeer):  # a stranger, or a refused decode
            return
        why = f"decode engine {session.engine} lost: {reason}"
        self._on_link("lost")
        now = self._progress.clock.now()
        with self._transition():
            if self._sessions.get(session.engine) is session:
                del self._sessions[session.engine]
            for rid in list(session.requests):
                req = self._table.find(rid)
                if isinstance(req, PrefillRequest) and req.session is session:
                    self._apply(req, req.life.on_link_lost(why, now, bool(unfinished(req.handles))))
            self.cut(session, why, fenced=False, reopen=False)

    # -- close (progress thread, then the closing thread) --------------------------------------
    def close_data(self) -> None:
        """Close every peer's data connection (progress thread, at close; nothing reopens them)."""
        with self._transition():
            closing = [s.conn for s in self._sessions.values() if s.conn is not None]
            for s in self._sessions.values():
                s.conn, s.epoch = None, s.epoch + 1
        for conn in closing:
            conn.close()

    def close_links(self, reason: str) -> None:
        """Close every control link and stop listening (progress thread, at close)."""
        for link in list(self._links):
            link.close(reason)
        if self._listener is not None:
            try:
                self._progress.selector.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()

    def join(self, timeout: float) -> None:
        """Join the data-connection workers (bounded), once the transport is closed."""
        self._data.close(timeout)
