"""The decode's dials: reaching a prefill it has not reached yet (#18, #20).

A mixin of `DecodeEngine`, split off so the engine module stays the request
driver. It owns the part of a prefill peer's life before its control link
first connects:

- The bootstrap host is resolved off the progress thread (`resolver`): a
  literal address at once, a name by a worker whose answer is posted back;
  the family is the answer's. An answer not in by the end of the window is
  given up on (and dropped if it comes later).
- A dial that never connects — nothing listening yet, because the decode
  started first; a name that does not resolve yet — is retried with
  backoff (50 ms doubling to 1 s) until `connect_timeout` has passed since
  the first one; then the peer's waiting requests fail as "cannot reach",
  never as "lost" (nothing was lost). A request whose own `request_timeout`
  ends first while its prefill was never reached fails with that reason too,
  and the dials go on for the others.
- Once connected, the peer is the engine's (`decode.py`: Hello, Welcome, a
  loss, a refusal).

All of it runs on the progress thread: no step waits on the network there.
It reads the engine's `_sessions`, `_lock`, `_lookups`, `_progress`,
`_pools`, `_transport`, `config` and `engine_id`, and calls its `_apply`,
`_fence`, `_on_message` and `_link_lost`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from pdxfer.transport.errors import PeerLostError

from .inbound import DecodeRequest, PrefillPeer
from .protocol import Hello
from .resolver import Addrs, numeric
from .session import Link, parse_address

log = logging.getLogger("pdxfer")

# Redials of a prefill not reachable yet: 50 ms, doubling, at most 1 s apart.
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0


class Dials:
    """Dialling prefills for `DecodeEngine` (see the module docstring for what it reads)."""

    _sessions: dict[str, PrefillPeer]
    _lock: Any
    _lookups: Any
    _progress: Any
    _pools: Any
    _transport: Any
    _closed: bool
    config: Any
    engine_id: str
    # ... and calls the engine's `_apply`, `_fence`, `_on_message`, `_link_lost` (no stubs:
    # this class precedes `Engine` in the MRO, so a stub would shadow the real method).

    def _start(self, req: DecodeRequest) -> None:
        """Bind a new request to its prefill's peer, dialling a prefill not known yet."""
        if self._closed:
            return
        session = self._sessions.get(req.peer)
        new = session is None
        if new:
            session = PrefillPeer(req.peer, time.monotonic() + self.config.connect_wait)
            self._sessions[req.peer] = session
        with self._lock:
            req.session = session
            session.requests.add(req.id)
            if session.ready:
                self._apply(req, req.life.on_link_ready(time.monotonic()))
            else:
                session.waiting.append(req)
        if new:
            self._connect(session)

    def _connect(self, session: PrefillPeer) -> None:
        """One dial attempt: a literal address at once, a host name once resolved off-thread."""
        host, port = parse_address(session.addr)
        addrs = numeric(host, port)
        if addrs is None:
            session.resolving = True
            self._lookups.start(session, host, port)
        else:
            self._dial(session, addrs)

    def _resolved(self, session: PrefillPeer, addrs: Addrs | None, error: BaseException | None) -> None:
        if self._closed or not session.resolving or self._sessions.get(session.addr) is not session:
            return  # given up on (the window passed), or replaced
        session.resolving = False
        if not addrs:
            host = parse_address(session.addr)[0]
            return self._not_reached(session, f"cannot resolve {host!r}: {error or 'no address'}")
        self._dial(session, addrs)

    def _dial(self, session: PrefillPeer, addrs: Addrs) -> None:
        family, sockaddr = addrs[session.attempts % len(addrs)]  # each retry, the next address
        try:
            link = Link.dial(family, sockaddr, self._progress, f"prefill at {session.addr}",
                             self._on_message,
                             lambda lk, why: self._progress.call(self._link_lost, lk, why))
        except OSError as exc:
            return self._not_reached(session, f"cannot connect to prefill at {session.addr}: {exc}")
        link.owner, session.link = session, link
        link.send(Hello(self.engine_id, self.config.transport, self._transport.address(),
                        **self._pools.hello_fields()))

    def _not_reached(self, session: PrefillPeer, why: str) -> None:
        """A dial that never connected: retry within connect_timeout, else fail its requests."""
        session.link = None
        session.attempts += 1
        session.why_not = why
        now = time.monotonic()
        if not self._closed and now < session.connect_by:
            delay = min(_RETRY_MAX, _RETRY_FIRST * 2 ** min(session.attempts - 1, 16))
            session.retry_at = min(now + delay, session.connect_by)
            log.debug("pdxfer decode: prefill at %s not reachable yet (attempt %d: %s); retrying "
                      "in %.2f s", session.addr, session.attempts, why, session.retry_at - now)
            return
        if self._sessions.get(session.addr) is session:
            del self._sessions[session.addr]  # the next request dials afresh, with a new window
        self._fail_unreached(session, session.waiting,
                             f"within {self.config.connect_wait} s (connect_timeout")

    def _fail_unreached(self, session: PrefillPeer, reqs: list[DecodeRequest], within: str) -> None:
        """Fail `reqs` (waiting on `session`) as not reached: the attempts and the last reason."""
        n = session.attempts
        reason = (f"cannot reach prefill at {session.addr} {within}; {n} attempt"
                  f"{'s' if n != 1 else ''}): {session.why_not or 'still connecting'}")
        error = PeerLostError(reason)
        gone = {id(r) for r in reqs}
        with self._lock:
            session.waiting = [r for r in session.waiting if id(r) not in gone]
            fence = [r for r in reqs if self._apply(r, r.life.on_link_lost(reason, error))]
        self._fence(session, fence)

    def _tick_dials(self, now: float) -> tuple[list[tuple[Link, str]], float]:
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
                self._not_reached(session, f"no answer resolving {parse_address(session.addr)[0]!r}")
                continue
            if link is not None and now >= session.connect_by:
                close.append((link, f"connect to prefill at {session.addr} did not complete"))
            with self._lock:
                expired = [r for r in session.waiting if r.life.deadline <= now]
            if expired:
                self._fail_unreached(session, expired,
                                     f"within the request's {self.config.request_wait} s (request_timeout")
        return close, wake
