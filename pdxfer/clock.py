"""The time an engine's timeout logic reads: one clock per engine, injectable.

Every deadline an engine keeps — a request's wait, a link's liveness, a
decode's confirm window, a dial's connect window, a heartbeat's next turn —
is computed from `clock.now()` of the clock the engine was built with, never
from `time.monotonic()` directly. In production that clock is `MONOTONIC`.
A test hands the engine a `ManualClock` and moves time itself
(`clock.advance(seconds)`): a fault whose bound is two seconds is then tested
in milliseconds, and the test decides exactly which side of the bound it
looks at. The design follows trio's `MockClock` (trio.testing): virtual time
that only moves when told, with the loops waiting on it woken when it does.

What the clock does *not* govern: waits on real events (a worker thread's
join, a transport handle's completion, a socket's readiness). Those stay in
real time, bounded by the same configured numbers, because no test can
advance a kernel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["MONOTONIC", "Clock", "ManualClock", "MonotonicClock"]


class Clock(Protocol):
    """What an engine asks of its clock."""

    def now(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` whenever time jumps (not as it flows); returns the un-watch."""


class MonotonicClock:
    """Real time (`time.monotonic`): it flows by itself, so nobody is ever woken by a jump."""

    def now(self) -> float:
        """`time.monotonic()`."""
        return time.monotonic()

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Real time never jumps: nothing to watch."""
        return _nothing


def _nothing() -> None:
    pass


MONOTONIC = MonotonicClock()


class ManualClock:
    """Virtual time for tests: `now()` moves only by `advance`, which wakes every watcher.

    Each engine's progress loop watches its clock, so after `advance` returns
    the loop runs a tick at its next turn and sees the new time; what that tick
    decides (a request failed, a link declared dead) still arrives through the
    engine's ordinary API (`wait`, `poll`), synchronised on real events.
    """

    def __init__(self, start: float = 1000.0) -> None:
        # Not 0: code that tests `if deadline:` or keeps 0.0 as "never" must not be fooled.
        self._now = float(start)
        self._lock = threading.Lock()
        self._watchers: dict[int, Callable[[], None]] = {}
        self._ids = 0

    def now(self) -> float:
        """The virtual time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (>= 0) and wake every watcher (outside the lock)."""
        if not seconds >= 0:  # NaN fails too
            raise ValueError(f"a clock only moves forward: advance({seconds!r}); pass seconds >= 0")
        with self._lock:
            self._now += seconds
            wakes = list(self._watchers.values())
        for wake in wakes:
            wake()

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` after every `advance`; the returned function stops that."""
        with self._lock:
            key = self._ids
            self._ids += 1
            self._watchers[key] = wake

        def unwatch() -> None:
            with self._lock:
                self._watchers.pop(key, None)
        return unwatch
