"""One progress loop's thread: start, stop and kick, a bounded join, one exception policy.

Every engine here has one thread that makes progress — the PD engine's
selector loop (`pdxfer.progress`), the nixl and verbs backends' polling loops
(`nixl/progress.py`, `verbs/progress.py`) — and each used to carry its own
copy of the same four things, each a little different: starting the thread,
a stop flag and a wake-up, a join that gives up after a while, and what to do
when a round raises (#29). They differ only in what a round does and how it
sleeps; this class is the rest, once:

- `turn()` is one round, supplied by the owner; it returns how long the loop
  may sleep before the next one (0: go again at once). A loop that sleeps
  inside its round (in `select`) returns 0 and passes `wake=`, the call that
  interrupts that sleep; otherwise the sleep is an `Event.wait`, and the
  event is cleared *before* the round runs, so a `kick()` that comes during
  a round is never lost (the round after it starts at once).
- `stop(timeout)` sets the flag, kicks, and joins within `timeout`, never
  from the loop's own thread (a handler closing its engine would wait for
  itself); it says whether the thread ended, so the owner can leave what
  the thread may still touch to the collector instead of freeing it.
- The exception policy: the owner guards what it calls for others (a peer's
  handler, a queued call) and decides what survives; anything that escapes
  a round is a bug of the loop itself, after which nothing would move, so
  it is not retried in a tight loop logging every turn: the loop ends, the
  error is logged once with its traceback, kept (`failure`, a
  `TransportError` chained to it), and `on_failure(error)` runs on a thread
  of its own — the owner fails what is pending there (a link's handles, a
  request), at once rather than after their own timeouts, and may wait for
  things that wait for this thread, which has ended by then.

The ucx backend's thread (`ucx/progress.py`) follows the same policy with
its own code (it also owns UCX objects' destruction); moving it onto this
class is left to the work on its crash (#29.7).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .errors import TransportError

log = logging.getLogger(__name__)


class LoopThread:
    """A daemon thread running `turn()` until stopped (see the module docstring)."""

    def __init__(self, name: str, turn: Callable[[], float], *,
                 on_failure: Callable[[TransportError], None] | None = None,
                 wake: Callable[[], None] | None = None) -> None:
        """Start the thread now; `name` names it and its failure (`"nixl-progress e1"`)."""
        self.name = name
        self._turn = turn
        self._on_failure = on_failure
        self._wake_hook = wake
        self._wake = threading.Event()
        self._stopping = False
        self.failure: TransportError | None = None  # why the loop ended early, if it did
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def on_thread(self) -> bool:
        """Whether the caller is this loop's thread (a handler runs there)."""
        return threading.current_thread() is self._thread

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called (the loop ends after the current round)."""
        return self._stopping

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def kick(self) -> None:
        """Run a round now (or end the sleep of the current one). Never blocks."""
        self._wake.set()
        if self._wake_hook is not None:
            self._wake_hook()

    def stop(self, timeout: float) -> bool:
        """Stop after the current round and join within `timeout` s; True if the thread ended.

        Idempotent. On the loop's own thread it only asks: the round ends
        when the handler that called it returns.
        """
        self._stopping = True
        self.kick()
        if not self.on_thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()  # before the round: a kick during it is not lost
                delay = self._turn()
                if delay > 0 and not self._stopping:
                    self._wake.wait(delay)
        except BaseException as exc:  # the engine's only progress thread: nobody else would see it
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        error = TransportError(
            f"{self.name}: the progress loop failed ({type(exc).__name__}: {exc}); nothing of "
            "this engine moves any more and what was pending fails with this error: close the "
            "engine and make a new one (and report the traceback logged with it)")
        error.__cause__ = exc
        self.failure = error
        log.error("%s: the progress loop failed; every pending operation fails with it",
                  self.name, exc_info=exc)
        if self._on_failure is not None:
            threading.Thread(target=self._on_failure, args=(error,), daemon=True,
                             name=f"{self.name}-failed").start()
