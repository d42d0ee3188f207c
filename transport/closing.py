"""How a `close()` runs, once for the kit and the PD engine: every step, one deadline, one error.

A close is a list of named steps (stop the listener, fence inbound links,
close outbound links, ...). Three rules make it total and retryable (#29
item 4), and before this module each close broke all three:

* **every step runs.** A step that raises is recorded and the next step runs
  anyway: one backend failure must not leave regions registered and links
  open behind it.
* **one error, at the end.** The failures are raised once, as one
  `CloseError` naming each failed step (chained `from` the first).
* **retryable.** `Steps` remembers which steps finished; a second `close()`
  runs only the ones that did not (a step that failed, or one that ran out
  of time), so a close that failed once can be finished by calling it again.

`concurrently` is the deadline half: work per peer (a goodbye, a join) runs
on one short-lived thread per item, all waited for under one shared deadline,
so a close's bound is that deadline whatever the number of peers — not one
per-peer wait after another (50 stalled peers used to cost 50 × `BYE_WAIT`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .errors import CloseError

log = logging.getLogger(__name__)

T = TypeVar("T")
BYE_WAIT = 1.0  # how long a control link's close waits for its peer to fence it and hang up


def left(deadline: float) -> float:
    """Seconds until `deadline` (monotonic), never below zero."""
    return max(0.0, deadline - time.monotonic())


class Steps:
    """The named steps of one object's close, run under `run`; finished ones never run again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done: set[str] = set()
        self._lock = threading.Lock()  # one run at a time

    @property
    def finished(self) -> bool:
        """Whether every step has finished (a later `run` has nothing left to do)."""
        return self._finished

    _finished = False

    def run(self, steps: Sequence[tuple[str, Callable[[], bool | None]]]) -> bool:
        """Run each step not yet finished, in order, every one even if an earlier one raised.

        A step returns False when something it waits for was still running at
        the deadline (a thread that ends on its own bound): not an error, but
        not finished either — the next `run` runs it again. Returns False if
        another thread is running the steps now (that run finishes the job),
        else True. `CloseError` naming each step that raised, after all ran.
        """
        if not self._lock.acquire(blocking=False):
            return False
        failures: list[tuple[str, BaseException]] = []
        try:
            for name, step in steps:
                if name in self._done:
                    continue
                try:
                    finished = step()
                except Exception as exc:  # collected, raised once below: the next step still runs
                    failures.append((name, exc))
                    continue
                if finished is False:
                    log.warning("closing %s: %s still running at the deadline; close() again "
                                "waits for it", self.what, name)
                else:
                    self._done.add(name)
            self._finished = len(self._done) >= len({name for name, _ in steps})
        finally:
            self._lock.release()
        if failures:
            raise CloseError(self.what, failures) from failures[0][1]
        return True


def each(what: str, items: Iterable[T], step: Callable[[T], None],
         name: Callable[[T], str] = repr) -> None:
    """`step(item)` for every item, even after one raised; one `CloseError` naming each failed item."""
    failures: list[tuple[str, BaseException]] = []
    for item in items:
        try:
            step(item)
        except Exception as exc:
            failures.append((name(item), exc))
    if failures:
        raise CloseError(what, failures) from failures[0][1]


def concurrently(what: str, items: Iterable[T], step: Callable[[T], None], deadline: float,
                 name: Callable[[T], str] = repr) -> list[T]:
    """`step(item)` for every item at once, one daemon thread each, waited for until `deadline`.

    Returns the items whose step was still running at the deadline (their
    threads keep running and end on their own bound); one `CloseError`
    naming each item whose step raised. A single item runs on the caller's
    thread.
    """
    items = list(items)
    if not items:
        return []
    errors: dict[int, BaseException] = {}
    if len(items) == 1:
        try:
            step(items[0])
        except Exception as exc:
            errors[0] = exc
        threads: list[threading.Thread] = []
    else:
        def work(i: int, item: T) -> None:
            try:
                step(item)
            except Exception as exc:  # reported to the closer below
                errors[i] = exc

        threads = [threading.Thread(target=work, args=(i, item), daemon=True,
                                    name=f"close {what} {i}") for i, item in enumerate(items)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(left(deadline))
    failures = [(name(item), errors[i]) for i, item in enumerate(items) if i in errors]
    if failures:
        raise CloseError(what, failures) from failures[0][1]
    return [item for i, item in enumerate(items) if threads and threads[i].is_alive()]
