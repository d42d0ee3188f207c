"""The decode's first contact with a prefill: reaching it, and a refusal's news (#18, #20).

A collaborator of `DecodeEngine` (`Dials`), split off so the engine module
stays the request driver, and handed only what it needs (#29: a narrow
interface, not the engine's private fields). It owns the part of a prefill
peer's life before its control link first connects:

- The bootstrap host is resolved off the progress thread (`resolver`): a
  literal address at once, a name by a worker whose answer is posted back;
  the family is the answer's. An answer not in by the end of the window is
  given up on (and dropped if it comes later).
- A dial that never connects — nothing listening yet, because the decode
  started first; a name that does not resolve yet — is retried with
  backoff (50 ms doubling to 1 s) until `connect_timeout` has passed since
  the first one; then the peer's waiting requests fail as "not reached",
  never as "lost" (nothing was lost). A request whose own `request_timeout`
  ends first while its prefill was never reached fails with that reason too,
  and the dials go on for the others.
- An address whose prefill was reached and then lost is not redialled: a
  refused connect there means it is gone, and requests to it fail at once,
  as before (a restarted one serves the first request that finds it up).
  The set of such addresses is bounded (`_GONE_LIMIT`, oldest forgotten).
- A refused handshake (`_doom`): before hanging up, the decode tells the
  prefill which of its requests the refusal fails, in the words they fail
  with, so the prefill's senders fail at once too, not after
  `request_timeout` with "no decode expected it".
- Once connected, the peer is otherwise the engine's (`decode.py`: Hello,
  Welcome, a loss, the directory's incarnations).

All of it runs on the progress thread: no step waits on the network there.
What it is given: the engine's peer table (`sessions`, shared: the engine
drops a lost peer from it), the progress loop, the table lock (to read the
requests' deadlines), the config, how to say Hello, the link's two
callbacks, how to fail requests waiting on a peer (`fail`, a transition of
the engine's), and whether the engine is closing.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from typing import Any

from pdxfer.transport.errors import PeerLostError

from .expects import DecodeRequest, PrefillPeer
from .handshake import why_lost
from .protocol import Abort, Hello
from .resolver import Addrs, Lookups, numeric
from .session import ControlConn, parse_address

log = logging.getLogger("pdxfer")

# Redials of a prefill not reachable yet: 50 ms, doubling, at most 1 s apart.
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
# Addresses remembered as reached-then-lost (not redialled), oldest forgotten first.
_GONE_LIMIT = 1024


class Dials:
    """Dialling prefills for `DecodeEngine` (see the module docstring for what it is given)."""

    def __init__(self, *, sessions: dict[str, PrefillPeer], progress: Any, lock: Any, config: Any,
                 name: str, hello: Callable[[], Hello],
                 on_message: Callable[[ControlConn, Any], None],
                 on_link_lost: Callable[[ControlConn, str], None],
                 fail: Callable[[PrefillPeer, list[DecodeRequest], str, BaseException], None],
                 closed: Callable[[], bool],
                 on_link: Callable[..., None] = lambda event, kind="": None) -> None:
        self._sessions = sessions
        self._on_link = on_link  # told of each dial attempt: the metrics
        self._progress = progress
        self._lock = lock
        self.config = config
        self._hello = hello
        self._on_message = on_message
        self._link_lost = on_link_lost
        self._fail = fail
        self._is_closed = closed
        self._lookups = Lookups(f"pdxfer-resolve-{name}",
                                lambda *a: self._progress.call(self._resolved, *a))
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def _closed(self) -> bool:
        return self._is_closed()

    def close(self, timeout: float) -> None:
        """Stop the lookup workers (bounded)."""
        self._lookups.close(timeout)

    def dial(self, addr: str, expected: str | None) -> PrefillPeer:
        """A new peer for `addr`, its first dial queued behind the request binding to it."""
        session = PrefillPeer(addr, expected, self._progress.clock.now() + self.config.connect_wait,
                              retry=addr not in self._gone)
        self._sessions[addr] = session
        self._progress.call(self._connect, session)
        return session

    def reached(self, addr: str) -> None:
        """A prefill welcomed us at `addr`: it is back, if it was gone."""
        self._gone.pop(addr, None)

    def lost(self, addr: str) -> None:
        """The prefill at `addr`, once reached, is lost: a refused dial there fails at once."""
        self._gone[addr] = None
        self._gone.move_to_end(addr)
        while len(self._gone) > _GONE_LIMIT:
            self._gone.popitem(last=False)

    def _connect(self, session: PrefillPeer) -> None:
        """One dial attempt: a literal address at once, a host name once resolved off-thread."""
        if self._closed or self._sessions.get(session.addr) is not session:
            return  # replaced (a directory cut) or closing: its requests went with it
        host, port = parse_address(session.addr)
        addrs = numeric(host, port)
        if addrs is None:
            session.resolving = True
            self._lookups.start(session, host, port)
        else:
            self._dial_to(session, addrs)

    def _resolved(self, session: PrefillPeer, addrs: Addrs | None, error: BaseException | None) -> None:
        if self._closed or not session.resolving or self._sessions.get(session.addr) is not session:
            return  # given up on (the window passed), or replaced
        session.resolving = False
        if not addrs:
            host = parse_address(session.addr)[0]
            return self.not_reached(session, f"cannot resolve {host!r}: {error or 'no address'}")
        self._dial_to(session, addrs)

    def _dial_to(self, session: PrefillPeer, addrs: Addrs) -> None:
        family, sockaddr = addrs[session.attempts % len(addrs)]  # each retry, the next address
        self._on_link("dialed")
        try:
            link = ControlConn.dial(family, sockaddr, self._progress, f"prefill at {session.addr}",
                             self._on_message,
                             self._link_lost)
        except OSError as exc:
            return self.not_reached(session, f"cannot connect to prefill at {session.addr}: {exc}")
        link.owner, session.link = session, link
        link.send(self._hello())

    def not_reached(self, session: PrefillPeer, why: str) -> None:
        """A dial that never connected: retry within connect_timeout, else fail its requests."""
        session.link = None
        session.attempts += 1
        session.why_not = why
        now = self._progress.clock.now()
        if session.retry and not self._closed and now < session.connect_by:
            delay = min(_RETRY_MAX, _RETRY_FIRST * 2 ** min(session.attempts - 1, 16))
            session.retry_at = min(now + delay, session.connect_by)
            log.debug("pdxfer decode: prefill at %s not reachable yet (attempt %d: %s); retrying "
                      "in %.2f s", session.addr, session.attempts, why, session.retry_at - now)
            return
        if self._sessions.get(session.addr) is session:
            del self._sessions[session.addr]  # the next request dials afresh, with a new window
        self._fail_unreached(session, session.waiting,
                             f"within connect_timeout {self.config.connect_wait} s" if session.retry
                             else "not redialled: the prefill there was reached before, then lost")

    def _fail_unreached(self, session: PrefillPeer, reqs: list[DecodeRequest], when: str) -> None:
        """Fail `reqs` (waiting on `session`) as not reached: the last reason, the attempts."""
        n = session.attempts
        reason = (f"prefill at {session.addr} not reached (no handshake): "
                  f"{session.why_not or 'still connecting'}; {n} attempt{'s' if n != 1 else ''} "
                  f"{when}")
        self._fail(session, reqs, reason, PeerLostError(reason))

    def tick(self, now: float) -> tuple[list[tuple[ControlConn, str]], float]:
        """Redial, give up, and fail requests that waited out their wait unreached.

        Runs before the requests' own timers, so a request whose wait ends
        before its prefill was ever reached says so. Returns the links to
        close (a connect past the window) and seconds until it wants to run.
        """
        close, wake = [], math.inf
        for session in list(self._sessions.values()):
            link = session.link
            if link is not None and not link.connecting:
                continue  # reached: the engine's from here on
            if session.retry_at is not None:
                if now >= session.retry_at:
                    session.retry_at = None
                    self._connect(session)
                else:
                    wake = min(wake, session.retry_at - now)
            if session.resolving and now >= session.connect_by:
                session.resolving = False  # its answer, if it ever comes, is dropped
                self.not_reached(session, f"no answer resolving {parse_address(session.addr)[0]!r}")
                continue
            if link is not None and now >= session.connect_by:
                close.append((link, f"connect to prefill at {session.addr} did not complete"))
            with self._lock:
                expired = [r for r in session.waiting if r.life.deadline <= now]
            if expired:
                self._fail_unreached(session, expired,
                                     f"within the request's request_timeout {self.config.request_wait} s")
        return close, wake

    def doom(self, session: PrefillPeer) -> None:
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
