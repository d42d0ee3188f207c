"""The ordered post queue of one link, and the one thread per engine that waits out readiness.

Every write of every backend leaves the caller through a link's `PostQueue`,
which ends in that backend's `submit` (tcp: stripes onto its streams; nixl:
descriptors onto the progress thread's queue; verbs: WRs onto a rail;
loopback: onto the link's copy worker). `submit` never waits on a peer, so
posting costs the caller local work only.

Readiness. A CUDA source is final only once the producer's event is reached
(`transport.streams`). Where the head of a link's queue is not, the write
stays in the queue — later writes on that link wait behind it, so they keep
their order — and `Readiness`, one thread per engine, asks each waiting
queue's head `query()` with a short backoff and submits what became ready.
So no caller's thread ever waits for an event, no wait happens under an
engine or link lock (`query` is a non-blocking call, made with no lock
held), and a write that is not ready holds up only its own link: every
other link's queue is separate, and its writes are submitted inline. On CPU
`capture` returns None and the inline path is the only one; tests drive the
waiting path with a double that has `query()`.

A head not ready within the link's `connect_timeout` fails its handle with
`TransferTimeout` naming the fix (record `ready` after the producing work),
and the queue moves on.

Lock order: the queue shares its link's lock; `submit` runs under it and
must only hand work on (never block). Nothing here takes an engine lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import TransferTimeout, TransportError, again

log = logging.getLogger(__name__)

# Backoff of the readiness thread while some head waits: an event query costs ~1 us.
MIN_WAIT = 20e-6
MAX_WAIT = 1e-3
JOIN_TIMEOUT = 2.0


class Post:
    """One write on its way out: what the backend's `submit` receives (`table`: its `Link.plan`)."""

    __slots__ = ("deadline", "dst", "handle", "notify", "ready", "region", "seq", "src", "table")

    def __init__(self, seq: int, handle: Any, src: Any, region: int, dst: Any, table: Any,
                 notify: bytes | None, ready: Any) -> None:
        self.seq, self.handle, self.src, self.region, self.dst = seq, handle, src, region, dst
        self.table, self.notify, self.ready = table, notify, ready
        self.deadline = 0.0


def reached(ready: Any) -> bool:
    """Whether a captured readiness (None, or an object with `query()`) is reached."""
    return ready is None or bool(ready.query())


class PostQueue:
    """One link's writes in post order, handed to `submit` once each one's source is ready.

    `lock` is the link's own lock (the queue has none of its own);
    `submit(post)` runs under it. `fail(post, error)` fails one write that
    could not be submitted (called without the lock).
    """

    def __init__(self, lock: threading.Lock | threading.RLock, submit: Callable[[Post], None],
                 fail: Callable[[Post, TransportError], None], readiness: Readiness,
                 timeout: float, what: str) -> None:
        self._lock = lock
        self._submit = submit
        self._fail = fail
        self._readiness = readiness
        self._timeout = timeout
        self._what = what
        self._waiting: collections.deque[Post] = collections.deque()
        self._dead: TransportError | None = None

    def put(self, post: Post) -> None:
        """Submit now if nothing waits ahead and the source is ready; else queue it. Lock held.

        Exceptions from an inline `submit` propagate to the caller (the write
        was not posted).
        """
        if self._dead is not None:
            raise again(self._dead)
        if not self._waiting and reached(post.ready):
            self._submit(post)
            return
        post.deadline = time.monotonic() + self._timeout
        self._waiting.append(post)
        if len(self._waiting) == 1:
            self._readiness.watch(self)

    def pump(self) -> bool:
        """Submit the heads that became ready, in order (readiness thread); True while one waits."""
        while True:
            with self._lock:
                if not self._waiting:
                    return False
                head = self._waiting[0]
            ok = reached(head.ready)  # no lock held: a query never waits under a link lock
            expired = not ok and time.monotonic() > head.deadline
            if not ok and not expired:
                return True
            error: TransportError | None = None
            with self._lock:
                if not self._waiting or self._waiting[0] is not head:
                    continue  # the link died meanwhile (`stop` emptied the queue)
                self._waiting.popleft()
                if expired:
                    error = TransferTimeout(
                        f"{self._what}: the producer's CUDA event was not reached within "
                        f"{self._timeout} s; record `ready` after the work that writes the source")
                else:
                    try:
                        self._submit(head)
                    except TransportError as exc:
                        error = exc
                    except Exception as exc:  # a bug in submit: fail the write, keep the queue going
                        log.exception("%s: submitting a write failed", self._what)
                        error = TransportError(f"{self._what}: posting failed: {exc}")
            if error is not None:
                self._fail(head, error)

    def stop(self, error: TransportError) -> list[Post]:
        """The link died: refuse later writes with `error`; the writes still waiting. Lock held."""
        self._dead = error
        out = list(self._waiting)
        self._waiting.clear()
        return out

    @property
    def waiting(self) -> int:
        """Writes held for readiness (tests, benches)."""
        return len(self._waiting)


class Readiness:
    """One engine's thread that submits queued writes once their producers' events are reached.

    Started on first need (a write that was not ready): host-only engines
    never start it. Sleeps on an event while no queue waits.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queues: set[PostQueue] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, queue: PostQueue) -> None:
        """Look at `queue`'s head until it has none waiting."""
        with self._lock:
            if self._closed:
                return  # closing: the engine fails every link, and with it this queue
            self._queues.add(queue)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{self._name}-readiness")
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        delay = MIN_WAIT
        while True:
            with self._lock:
                if self._closed:
                    return
                queues = list(self._queues)
            if not queues:
                self._wake.wait()
                self._wake.clear()
                delay = MIN_WAIT
                continue
            done = [q for q in queues if not q.pump()]
            with self._lock:
                # a put() after our pump re-adds its queue (it calls watch after appending)
                self._queues.difference_update(q for q in done if not q.waiting)
            if done:
                delay = MIN_WAIT
            else:
                delay = min(delay * 2, MAX_WAIT)
            self._wake.wait(delay)
            self._wake.clear()

    def close(self) -> None:
        """Stop and join the thread (bounded). Idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT)
