"""The one thread that calls UCX: it owns every worker of an engine, posts, progresses, completes.

Every UCXX call of a running engine — creating workers and endpoints,
posting tag sends and receives, progress, completion checks, closing
endpoints and releasing workers — happens on this thread, so UCX is driven
from one thread and no lock is ever held across a UCX call. (The engine's
constructor makes its context and sending worker before this thread has any
of it, then hands the worker over with `adopt`.) Other threads hand it work with
`call(fn)` (a queue append and a wake-up: never blocks) or, where they need
the answer, `ask(fn, timeout)` (bounded).

The loop: run queued calls; progress every worker; complete the batches
whose requests all finished; then, if nothing is left to do, arm every
worker (UCX's wake-up: `ucp_worker_arm`) and sleep in `poll` on their
epoll descriptors and our wake pipe. No timer drives it: an idle engine
sleeps.

A `Batch` is the requests of one transfer on one worker: its callback runs
(on this thread, so it must only hand work on) once all completed, with the
first error among them, if any. Completion is checked in request order and
stops at the first unfinished one, so a pass costs one check per batch.

A failure of the loop itself (UCX raising out of `progress`, a bug of
ours: anything but what a queued call or a callback raised, which is
logged and survived) ends the thread the same way for every waiter
(`_failed`): the error is logged once with its traceback; every `ask`
still waiting, every batch still tracked and every `call` after it fails
with a `TransportError` chained to it; and the engine's `on_failure` hears
it (off this thread), so it can fail its links' handles — none waits out
its own timeout for a thread that is gone.

`retire(worker)` is the fence's core: after it, this thread never progresses
that worker again — so nothing lands through it — and its batches are
dropped without their callbacks (their link is gone).

Destruction on this thread too (`own`): a UCXX worker or endpoint is torn
down by its destructor (`ucp_ep_close`, `ucp_worker_destroy`), and a
Python object dies where its last reference goes — for a link in a
reference cycle, on whatever thread the cyclic collector happens to run,
while this one may be inside `progress()` on a worker of the same context.
So this thread keeps a reference to every worker and endpoint it makes and
lets one go (`_reap`, when idle and as it ends) only once that reference is
the last. Two full-suite runs here died in UCX (`worker.progress()`,
`close_blocking()`) under load before this; deletion condition: none while
any other thread can drop a UCXX object.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import sys
import threading
from collections.abc import Callable
from typing import Any

import pdxfer.transport.ucx.lib as lib  # absolute: `from . import` depends on ucx/__init__

from ..errors import ClosedError, TransferTimeout, TransportError

log = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # a safety net only: every event that matters wakes the poll
JOIN_TIMEOUT = 2.0


class Batch:
    """The UCX requests of one transfer on one worker, and what to do when they are all done."""

    __slots__ = ("done", "hold", "next", "requests", "worker")

    def __init__(self, worker: Any, requests: list[Any], done: Callable[[Exception | None], None],
                 hold: Any = None) -> None:
        self.worker = worker
        self.requests = requests
        self.done = done
        self.hold = hold  # what must stay alive while UCX uses it (the regions)
        self.next = 0

    def finished(self) -> tuple[bool, Exception | None]:
        """`(all done, first error)`; checks from where the last pass stopped."""
        reqs = self.requests
        while self.next < len(reqs):
            req = reqs[self.next]
            if not req.completed:
                return False, None
            error = lib.status(req)
            if error is not None:
                return True, error
            self.next += 1
        return True, None


class Progress:
    """An engine's UCX thread; `call`/`ask` hand it work, `stop` ends it."""

    def __init__(self, name: str,
                 on_failure: Callable[[TransportError], None] | None = None) -> None:
        """`on_failure(error)`: the loop died (module docstring); called once, on a thread of its own."""
        self._name = name
        self._on_failure = on_failure
        self.failure: TransportError | None = None  # why the loop died, if it did
        self._asks: dict[int, tuple[threading.Event, list]] = {}  # waiting `ask`s (under `_lock`)
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._workers: dict[int, Any] = {}  # id(worker) -> worker, progressed every pass
        self._batches: list[Batch] = []
        self._owned: list[Any] = []  # every worker and endpoint made: destroyed here (`own`)
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, select.POLLIN)
        self._stopping = False  # stop asked: exit once nothing is queued
        self._closed = False  # the loop ended: `call` refuses (under `_lock`)
        self._lock = threading.Lock()
        self.abandoned = 0  # retired workers UCXX keeps alive through a matched receive
        self._thread = threading.Thread(target=self._run, name=f"{name}-progress", daemon=True)
        self._thread.start()

    # -- handing work over ---------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the progress thread, in call order. Never blocks.

        `ClosedError` once the thread has ended: then no worker is progressed
        any more, which is all a caller retiring one needs to know.
        """
        with self._lock:
            if self._closed:
                raise self._ended()
            self._queue.append(fn)
        self.kick()

    def _ended(self) -> ClosedError:
        error = ClosedError(f"{self._name}'s UCX thread has ended"
                            + (f" ({self.failure})" if self.failure is not None else ""))
        error.__cause__ = self.failure
        return error

    def ask(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        """Run `fn` on the progress thread and return its result (or raise its error), bounded."""
        if threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: list[Any] = [None, None]

        def run() -> None:
            try:
                box[0] = fn()
            except BaseException as exc:  # handed back to the asking thread
                box[1] = exc
            done.set()

        with self._lock:
            self._asks[id(box)] = (done, box)  # failed by `_failed` if the loop dies first
        try:
            self.call(run)
            if not done.wait(timeout):
                raise TransferTimeout(f"{self._name}: {what} did not finish within {timeout} s")
        finally:
            with self._lock:
                self._asks.pop(id(box), None)
        if box[1] is not None:
            raise box[1]
        return box[0]

    def kick(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full: the thread is awake anyway
        except OSError:
            pass  # closed: the thread is gone

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (False once `stop` ended it)."""
        return self._thread.is_alive()

    # -- thread-side API (called from `call`ed functions) ----------------------------------
    def own(self, obj: Any) -> Any:
        """Keep UCXX object `obj` (a worker or an endpoint) until only we hold it; returns it.

        Its destructor then runs on this thread (`_reap`), never on one that
        dropped the last other reference while we drive its context.
        """
        self._owned.append(obj)
        return obj

    def adopt(self, worker: Any) -> None:
        """Progress `worker` from now on (and own it)."""
        self.own(worker)
        self._workers[id(worker)] = worker
        self._poll.register(worker.epoll_file_descriptor, select.POLLIN)

    def track(self, batch: Batch) -> None:
        """Complete `batch` once its requests are done."""
        self._batches.append(batch)

    def retire(self, worker: Any) -> int:
        """Never progress `worker` again; forget its batches (their callbacks never run).

        Returns how many of its receives were already matched and unfinished:
        those keep the worker allocated (UCXX holds it through them) but, never
        progressed, it moves no byte — it is abandoned until the process exits.
        """
        if self._workers.pop(id(worker), None) is not None:
            self._poll.unregister(worker.epoll_file_descriptor)
        mine = [b for b in self._batches if b.worker is worker]
        self._batches = [b for b in self._batches if b.worker is not worker]
        lib.release_worker(worker)  # cancels what is unmatched: those complete at once
        stuck = sum(1 for b in mine for req in b.requests[b.next:] if not req.completed)
        if stuck:
            self.abandoned += 1
        return stuck

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the engine's only UCX thread: nobody else would see it
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """The loop died of `exc`: log it once, fail every waiter and batch, tell the engine."""
        log.error("%s: the UCX thread failed; every operation of this engine fails with it",
                  self._name, exc_info=exc)
        error = TransportError(f"{self._name}'s UCX thread failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self._lock:
            self.failure = error
            self._closed = True  # `call` and `ask` refuse from now on
            asks, self._asks = list(self._asks.values()), {}
            self._queue.clear()
        for done, box in asks:
            box[1] = error
            done.set()
        batches, self._batches = self._batches, []
        self._workers.clear()
        for batch in batches:
            try:
                batch.done(error)
            except Exception:
                log.exception("%s: a completion callback failed", self._name)
        if self._on_failure is not None:
            # off this thread: the engine fences and severs, and a fence may wait for this one
            threading.Thread(target=self._on_failure, args=(error,), daemon=True,
                             name=f"{self._name}-ucx-failed").start()

    def _loop(self) -> None:
        while True:
            ran = self._run_calls()
            if self._stopping and not self._queue:
                with self._lock:
                    self._closed = True
                self._run_calls()  # what was queued before `call` could refuse; no progress after
                self._workers.clear()
                self._batches.clear()
                self._reap()  # what is still held elsewhere dies later, with this thread gone
                return
            for worker in list(self._workers.values()):
                worker.progress()
            self._complete()
            if ran or self._queue:
                continue
            self._reap()
            if all(worker.arm() for worker in list(self._workers.values())):
                self._poll.poll(IDLE_POLL_MS)
                self._drain_wake()

    def _run_calls(self) -> bool:
        ran = False
        while self._queue:
            fn = self._queue.popleft()
            ran = True
            try:
                fn()
            except Exception:  # a caller's bug must not stop the engine's only UCX thread
                log.exception("%s: a queued call failed", self._name)
        return ran

    def _complete(self) -> None:
        if not self._batches:
            return
        keep: list[Batch] = []
        finished: list[tuple[Batch, Exception | None]] = []
        for batch in self._batches:
            done, error = batch.finished()
            if done:
                finished.append((batch, error))
            else:
                keep.append(batch)
        self._batches = keep
        for batch, error in finished:
            try:
                batch.done(error)
            except Exception:
                log.exception("%s: a completion callback failed", self._name)

    def _reap(self) -> None:
        """Let go of the owned objects no one else holds: their destructors run here, now."""
        if self._owned:
            # 3 = the list's slot, the comprehension's name, getrefcount's argument
            self._owned = [obj for obj in self._owned if sys.getrefcount(obj) > 3]

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # -- shutdown ---------------------------------------------------------------------------
    def stop(self) -> bool:
        """Run what is queued, then end the thread (joined, bounded); False if it did not end."""
        self._stopping = True
        self.kick()
        if not self.on_thread:
            self._thread.join(JOIN_TIMEOUT)
        ended = not self._thread.is_alive()
        if ended:
            os.close(self._wake_r)
            os.close(self._wake_w)
        return ended
