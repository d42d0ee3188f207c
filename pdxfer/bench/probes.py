"""Timing pieces of one engine's calls without changing anything another caller shares.

`pdxfer bench engine` and `pdxfer bench request-cost` split the time of a
`PrefillEngine.send()` into planning, posting and the rest. The first
versions did it by assigning timed wrappers to `layout.plan_segments`, to the
connection's class and to a module function — for the whole process, undone
in a `finally`: every other engine, thread or test in that process ran the
wrappers too, and an interrupted run left them there.

Here a `Probe` stands in for one object (one `Route`, one `Connection`) and
times the methods it is given; every other attribute is the object's own.
`probe_prefill` puts probes into one prefill engine's per-peer sessions — the
routes it plans with and the data connection it posts on — and nowhere else.
It reaches into that engine's private session table, which a bench that
times the engine's insides cannot avoid; delete it together with those
benches' split columns if the engine ever reports the split itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Probe", "Split", "probe_prefill"]


class Split:
    """Time spent inside the callables it wrapped, summed until the caller resets `total`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter_ns) -> None:
        self.total: float = 0
        self.clock = clock

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, adding the time of each call to `total`."""
        clock = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += clock() - t
        return timed


class Probe:
    """`target` with the named methods timed; reads and writes of anything else go to `target`."""

    def __init__(self, target: Any, **timed: Split) -> None:
        object.__setattr__(self, "_target", target)
        for name, split in timed.items():
            object.__setattr__(self, name, split.wrap(getattr(target, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)


def probe_prefill(prefill: Any, plan: Split, write: Split, timeout: float = 60.0) -> None:
    """Time `Route.plan` and `Connection.write` of every peer `prefill` is connected to now.

    Waits (up to `timeout` seconds) until each peer's data connection is open:
    its handshake worker opens it in the background. A connection opened
    later (a reconnect after a fault) is not probed.
    """
    deadline = time.monotonic() + timeout
    sessions = list(prefill.peers())
    while not all(s.ready for s in sessions):
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: a data connection did not open within {timeout} s")
        time.sleep(0.001)
    for session in sessions:
        session.routes = {pool: Probe(route, plan=plan) for pool, route in session.routes.items()}
        session.conn = Probe(session.conn, write=write)
