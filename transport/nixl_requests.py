"""The nixl engine's outgoing NIXL requests: queued by callers, posted and polled by its progress thread.

Why apart from `nixl.py`: every NIXL call on the engine's one initiating
agent is serialised by the agent lock, and some of them (loading a new
peer's metadata, a first message to it, forgetting a dead one) run for tens
of ms of UCX work under CPU load. A caller's `write()` must not wait that
out — a `send()` to one peer would be slowed by another — so a write only
appends its descriptors here (`queue`), and the progress thread, which
holds the agent for every poll anyway, makes the NIXL calls: `post` in
queue order under one hold of the lock, then `poll` for DONE/ERR.

CUDA sources wait here too: UCX reads them itself, so a write whose
producer event is not yet reached stays at the head of the queue (later
writes keep their order behind it) until `event.query()` says so, or fails
with `TransferTimeout` past the engine's `connect_timeout`. No thread
blocks on the event.

Locking: `queue` is the callers' (a deque append is atomic); everything
else runs on the progress thread or, for `drop` and `release_all`, under the
agent lock held by the engine.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import PeerLostError, TransferTimeout, TransportError
from .nixl_progress import lost
from .nixl_wire import translate

if TYPE_CHECKING:
    from .nixl import NixlEngine
    from .nixl_conn import NixlConnection

log = logging.getLogger(__name__)


class _Send:
    """A posted NIXL request, polled until DONE/ERR and then released."""

    __slots__ = ("conn", "tries", "xfer")

    def __init__(self, conn: NixlConnection, xfer: Any) -> None:
        self.conn, self.xfer, self.tries = conn, xfer, 0


class Requests:
    """One engine's queue of writes not yet posted, and its posted NIXL requests."""

    def __init__(self, engine: NixlEngine) -> None:
        self._engine = engine
        self._queue: collections.deque = collections.deque()
        self._sends: list[_Send] = []

    def queue(self, conn: NixlConnection, seq: int, local: np.ndarray | None,
              remote: np.ndarray | None, note: bytes, mems: tuple[str, str], ready: Any) -> None:
        """Hand one write (no descriptors: a notify alone) to the progress thread. Caller's thread."""
        deadline = time.monotonic() + self._engine.connect_timeout if ready is not None else 0.0
        self._queue.append((conn, seq, local, remote, note, mems, ready, deadline))

    def post(self) -> tuple[list[tuple[NixlConnection, int, TransportError]], bool]:
        """Post the queued writes whose source is ready, in order (progress thread).

        Returns `(refused posts as (link, seq, error), whether any work was done or is waiting)`.
        """
        engine = self._engine
        posts, refused = [], []
        while self._queue:
            item = self._queue[0]
            ready, deadline = item[6], item[7]
            if ready is not None and not ready.query():
                if time.monotonic() <= deadline:
                    break  # later posts wait too: they keep their order
                refused.append((item[0], item[1], TransferTimeout(
                    f"a write to {item[0].peer}: the producer's CUDA event was not reached within "
                    f"{engine.connect_timeout} s; record `ready` after the work that writes the source")))
            else:
                posts.append(item)
            self._queue.popleft()
        if not posts:
            return refused, bool(refused) or bool(self._queue)
        with engine._agent_lock:
            agent = engine._agent
            if agent is None:
                return refused, True  # closing: close() fails every link's handles
            for conn, seq, local, remote, note, mems, _, _ in posts:
                if conn.dead:
                    continue  # its handles already failed with the link's error
                try:
                    if local is None:
                        agent.send_notif(conn.agent, note)
                        continue
                    ls = agent.get_xfer_descs(local, mems[0])
                    rs = agent.get_xfer_descs(remote, mems[1])
                    xfer = agent.initialize_xfer("WRITE", ls, rs, conn.agent, note)
                    state = agent.transfer(xfer)
                except Exception as exc:
                    refused.append((conn, seq, translate(exc, f"posting a write to {conn.peer}")))
                    continue
                self._sends.append(_Send(conn, xfer))
                if state == "ERR":
                    refused.append((conn, seq, PeerLostError(
                        f"NIXL refused to post a write to {conn.peer}: the link is broken")))
        return refused, True

    def poll(self) -> tuple[list[tuple[NixlConnection, TransportError]], bool]:
        """One look at every posted request: `(links to sever, whether any is still moving)`."""
        engine = self._engine
        failed = []
        with engine._agent_lock:
            agent = engine._agent
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
                    state = translate(exc, f"a write to {send.conn.peer}")
                if state == "PROC" and not send.conn.dead:
                    keep.append(send)
                    continue
                if state != "DONE" and not send.conn.dead:
                    failed.append((send.conn, lost(f"a write to {send.conn.peer}", state)))
                try:
                    send.xfer.release()
                except Exception:  # still active and not cancellable yet: retry next round
                    send.tries += 1
                    if send.tries < 1000:
                        keep.append(send)
            self._sends = keep
            moving = any(not s.conn.dead for s in keep)
        return failed, moving

    def drop(self, conn: NixlConnection) -> None:
        """Release a dead link's posted requests (agent lock held by the caller)."""
        keep = []
        for send in self._sends:
            if send.conn is conn:
                try:
                    send.xfer.release()
                    continue
                except Exception:  # still active: poll() retries the release
                    pass
            keep.append(send)
        self._sends = keep

    def release_all(self) -> None:
        """At close, agent lock held: release every request and forget the queue."""
        for send in self._sends:
            try:
                send.xfer.release()
            except Exception:
                log.debug("nixl: a request was still active at close")
        self._sends = []
        self._queue.clear()
