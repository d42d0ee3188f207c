"""The one background thread of an engine: control sockets, queued commands, timers.

Every socket an engine owns (the prefill's listener, every control link) is
non-blocking and served here, through one `selectors` loop, so an engine
costs one thread however many peers it talks to. Public calls on other
threads never touch a socket: they queue a command (`call`) and wake the loop
through a socketpair, and the loop runs it in order with everything else.
That keeps socket state single-threaded and makes "abort tells the peer at
once" mean: at the loop's next turn, microseconds later.

Time-driven work (deadlines, heartbeats, abort grace) runs in `tick`, which
the owner supplies and which says when it wants to run next; between ticks
the thread sleeps in `select` — there is no busy-spinning anywhere.

A handler that raises is logged and the loop carries on: one malformed peer
or one bug in a callback must not take down every other request's progress.
The thread itself, its stop and its bounded join, and what happens if
anything escapes a turn (a bug of the loop: logged once, kept as `failure`,
the loop ends) are the transport kit's `loop_thread.LoopThread`, shared with
the backends' progress loops (#29); this loop sleeps in `select`, so its
wake-up is the socketpair, handed to the kit as `wake`.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from pdxfer.transport.loop_thread import LoopThread

from .clock import MONOTONIC, Clock

log = logging.getLogger("pdxfer")

# Ticks never sleep longer than this, so a changed deadline is seen within it
# even if the owner under-reports its next wake-up.
_MAX_SLEEP = 0.25


class Progress:
    """A selector loop on its own thread, with a command queue and a tick."""

    def __init__(self, name: str, tick: Callable[[float], float], clock: Clock = MONOTONIC,
                 on_lag: Callable[[float], None] | None = None) -> None:
        self._tick = tick
        # Told how late each tick that came due by time ran (`observe`: progress-loop lag).
        self._on_lag = on_lag
        # Every deadline of the engine this loop serves reads this clock (pdxfer.clock); a
        # jump of a test's ManualClock asks for a tick, so the jump is seen at the next turn.
        self.clock = clock
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._drain)
        self._commands: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        # A wake-up byte is in flight and the loop has not yet begun draining
        # the commands: a call queued meanwhile is run by that drain, unsent.
        self._woken = False
        self._next_tick = 0.0
        self._tick_asked = False
        self._unwatch = clock.watch(self.tick_soon)
        self._loop = LoopThread(name, self._turn, wake=self.wake)

    @property
    def on_thread(self) -> bool:
        """Whether the caller is the progress thread (every handler runs there)."""
        return self._loop.on_thread

    @property
    def failure(self) -> BaseException | None:
        """Why the loop ended early (a bug escaped a turn), or None."""
        return self._loop.failure

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the progress thread, soon, in call order."""
        self._commands.append((fn, args))
        if not self._woken:  # a burst of calls costs one system call, not one each
            self._woken = True
            self.wake()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` like `call`, but leave waking the loop to `kick()`.

        For a caller holding a lock the loop's handlers take: the wake-up is a
        system call, which lets the threads it wakes run into that lock.
        """
        self._commands.append((fn, args))

    def kick(self) -> None:
        """Wake the loop for what `post` queued (once no lock is held)."""
        if self._commands and not self._woken:
            self._woken = True
            self.wake()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a wake-up is already pending; closed: we are stopping

    def tick_soon(self) -> None:
        """Ask for a tick at the loop's next turn (a deadline moved closer, or the clock jumped)."""
        # A flag, not `_next_tick = 0`: a tick running meanwhile would overwrite that with its
        # own next time and the ask would be lost; the flag is cleared before the tick reads
        # the clock, so an ask made during a tick gets a tick of its own.
        self._tick_asked = True
        self.wake()

    def _drain(self, _mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _turn(self) -> float:
        """One turn: sockets, then queued commands, then the tick if due; it sleeps in `select`."""
        # The loop's own turns are scheduled in real time; only the tick's `now` is the
        # engine clock's. Under a ManualClock the tick still polls what settles in real
        # time (the decode's landed transfers) at its cadence, and an `advance` asks for
        # a tick at once (`tick_soon`), so no deadline waits for time that will not flow.
        due = 0.0 if self._tick_asked else self._next_tick
        timeout = max(0.0, min(due - time.monotonic(), _MAX_SLEEP))
        try:
            events = self.selector.select(timeout)
        except OSError:  # a socket closed under select; its owner already knows
            events = []
        for key, mask in events:
            self._guard(key.data, mask)
        self._woken = False  # before draining: a call from now on wakes us again
        while self._commands:
            fn, args = self._commands.popleft()
            self._guard(fn, *args)
        real = time.monotonic()
        if self._tick_asked or real >= self._next_tick:
            if not self._tick_asked and self._on_lag is not None and self._next_tick:
                self._on_lag(real - self._next_tick)
            self._tick_asked = False
            try:
                self._next_tick = real + max(0.001, self._tick(self.clock.now()))
            except Exception:
                log.exception("pdxfer progress tick failed")
                self._next_tick = real + _MAX_SLEEP
        return 0.0  # the sleep was the select

    @staticmethod
    def _guard(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("pdxfer progress handler %r failed", fn)

    def stop(self, timeout: float) -> None:
        """Run what is queued, stop the loop and join it (bounded); idempotent."""
        self._unwatch()
        ended = self._loop.stop(timeout)
        # Commands queued after the last turn still run, here, so none is lost —
        # unless the thread is stuck, when running them here would race it.
        while self._commands and ended:
            fn, args = self._commands.popleft()
            self._guard(fn, *args)
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        try:
            self.selector.close()
        except Exception:
            pass
