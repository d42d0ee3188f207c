"""Short-lived worker threads an engine starts for waits that must not run on its own threads.

A data connection's dial (`handshake.DataLinks`) and a host name lookup
(`resolver.Lookups`) can each wait seconds on the network, so neither may
run on a caller's thread, the progress thread or under the table lock. Each
runs on a daemon thread of its own; this base keeps the set of them so that
`close()` takes no more work and joins what it started, for a bounded time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Workers:
    """One daemon thread per job, tracked until it ends; `close` joins them (bounded)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on a new worker; nothing after `close`."""
        thread = threading.Thread(target=self._guard, args=(fn, *args), daemon=True, name=self._name)
        with self._lock:
            if self._closed:
                return
            self._threads.add(thread)
        thread.start()

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self, timeout: float) -> None:
        """Take no more work and join the running workers for at most `timeout` in all."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        until = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))
