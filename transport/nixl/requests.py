"""The nixl engine's outgoing NIXL requests: queued by links, posted and polled by its progress thread.

Why apart from the links: every NIXL call on the engine's one initiating
agent holds its lock (`agent.Initiator`), and some of them (loading a new
peer's metadata, a first message to it, forgetting a dead one) run for tens
of ms of UCX work under CPU load. A caller's `write()` must not wait that
out — a `send()` to one peer would be slowed by another — so a link's
`submit` only appends its descriptors here (`queue`), and the progress
thread, which holds the agent for every poll anyway, makes the NIXL calls:
`post` in queue order under one hold of the lock, then `poll` for DONE/ERR.

Readiness is not waited here: the kit's post queue (`transport.posting`)
submits a write only once its producer's event is reached, so everything
queued here may go.

Locking: `queue` is the links' (a deque append is atomic); everything else
runs on the progress thread or, for `drop` and `release_all`, under the
initiator's lock held by the caller.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from ..errors import PeerLostError, TransportError
from .agent import Initiator, translate

log = logging.getLogger(__name__)


def lost(what: str, exc: BaseException | str) -> PeerLostError:
    """The error a transfer fails with when NIXL reports it broken."""
    return PeerLostError(f"{what} failed: {exc}; the peer died, closed or dropped us")


class _Send:
    """A posted NIXL request, polled until DONE/ERR and then released."""

    __slots__ = ("link", "tries", "xfer")

    def __init__(self, link: Any, xfer: Any) -> None:
        self.link, self.xfer, self.tries = link, xfer, 0


class Requests:
    """One engine's queue of writes not yet posted, and its posted NIXL requests.

    A link here is anything with `agent` (the peer agent's name), `peer`,
    `dead` and `ctx.drains` — the engine's `NixlLink`s. A dead link's request
    still running is released at once, unless its link drains (the peer
    cannot stop our writes: #25.1): then it is polled until it ends on its
    own, and `drained` says when none of that link's is left.
    """

    def __init__(self, initiator: Initiator) -> None:
        self._initiator = initiator
        self._queue: collections.deque = collections.deque()
        self._sends: list[_Send] = []
        self._rounds = threading.Condition()  # notified after every poll (`drained`)
        self._round = 0

    def queue(self, link: Any, seq: int, local: np.ndarray | None, remote: np.ndarray | None,
              note: bytes, mems: tuple[str, str]) -> None:
        """Hand one write (no descriptors: a notify alone) to the progress thread. Link's thread."""
        self._queue.append((link, seq, local, remote, note, mems))

    def post(self) -> tuple[list[tuple[Any, int, TransportError]], bool]:
        """Post every queued write, in order (progress thread): `(refused (link, seq, error), worked)`."""
        if not self._queue:
            return [], False
        posts, refused = [], []
        while self._queue:
            posts.append(self._queue.popleft())
        ini = self._initiator
        with ini.lock:
            agent = ini.agent
            if agent is None:
                return refused, True  # closing: close() fails every link's handles
            for link, seq, local, remote, note, mems in posts:
                if link.dead:
                    continue  # its handles already failed with the link's error
                try:
                    if local is None:
                        agent.send_notif(link.agent, note)
                        continue
                    ls = agent.get_xfer_descs(local, mems[0])
                    rs = agent.get_xfer_descs(remote, mems[1])
                    xfer = agent.initialize_xfer("WRITE", ls, rs, link.agent, note)
                    state = agent.transfer(xfer)
                except Exception as exc:
                    refused.append((link, seq, translate(exc, f"posting a write to {link.peer}")))
                    continue
                self._sends.append(_Send(link, xfer))
                if state == "ERR":
                    refused.append((link, seq, PeerLostError(
                        f"NIXL refused to post a write to {link.peer}: the link is broken")))
        return refused, True

    def poll(self) -> tuple[list[tuple[Any, TransportError]], bool]:
        """One look at every posted request: `(links to sever, whether any is still moving)`."""
        failed = []
        ini = self._initiator
        with ini.lock:
            agent = ini.agent
            if agent is None:
                return [], False
            try:  # progresses the worker when no request is posted: a notify-only send
                agent.get_new_notifs()  # moves only then (nobody writes to this agent)
            except Exception as exc:
                log.debug("nixl: progress of the initiating agent: %s", exc)
            keep = []
            for send in self._sends:
                try:
                    state = agent.check_xfer_state(send.xfer)
                except Exception as exc:
                    state = translate(exc, f"a write to {send.link.peer}")
                if state == "PROC" and (not send.link.dead or send.link.ctx.drains):
                    keep.append(send)  # a dead link that drains lets its writes end on their own
                    continue
                if state != "DONE" and not send.link.dead:
                    failed.append((send.link, lost(f"a write to {send.link.peer}", state)))
                try:
                    send.xfer.release()
                except Exception:  # still active and not cancellable yet: retry next round
                    send.tries += 1
                    if send.tries < 1000:
                        keep.append(send)
            self._sends = keep
            moving = any(not s.link.dead or s.link.ctx.drains for s in keep)
        with self._rounds:
            self._round += 1
            self._rounds.notify_all()
        return failed, moving

    def drained(self, link: Any, deadline: float, kick: Any) -> bool:
        """Wait (until `deadline`) until no request of `link` is posted; True if none is.

        Checked under the initiator's lock, which `post` holds while it posts:
        a write being posted as the link died is seen here once posted. Not
        from the progress thread (it is what ends them); `kick` wakes it.
        """
        while True:
            with self._rounds:
                seen = self._round
            with self._initiator.lock:
                if not any(send.link is link for send in self._sends):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            kick()
            with self._rounds:
                self._rounds.wait_for(lambda seen=seen: self._round != seen, left)

    def drop(self, link: Any) -> None:
        """Release a dead link's posted requests (the initiator's lock held by the caller)."""
        keep = []
        for send in self._sends:
            if send.link is link:
                try:
                    send.xfer.release()
                    continue
                except Exception:  # still active: poll() retries the release
                    pass
            keep.append(send)
        self._sends = keep

    def release_all(self) -> None:
        """At close, the initiator's lock held: release every request and forget the queue."""
        for send in self._sends:
            try:
                send.xfer.release()
            except Exception:
                log.debug("nixl: a request was still active at close")
        self._sends = []
        self._queue.clear()
