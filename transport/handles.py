"""The transfer handle every backend returns: an event, an error slot, a byte count.

Completion and failure are set exactly once, from whichever backend thread
learns first (the data mover, an ack reader, a close); later attempts are
ignored, so a transfer that completed is never turned into a failure by a
close that races it. Waiting is an `Event.wait` — no polling loop.
"""

from __future__ import annotations

import threading

from .base import TransferHandle
from .errors import TransferTimeout, TransportError


class Handle(TransferHandle):
    """A posted transfer; `wait()` returns once every byte is in the peer's memory."""

    __slots__ = ("_done", "_error", "_lock", "_nbytes", "what")

    def __init__(self, nbytes: int, what: str) -> None:
        self._nbytes = nbytes
        self.what = what  # e.g. "tcp transfer 7 to engine ab12" — for error messages
        self._done = threading.Event()
        self._error: TransportError | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def complete(self) -> bool:
        """Mark done; False if the handle had already finished (either way)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._done.set()
            return True

    def fail(self, error: TransportError) -> bool:
        """Record `error` and mark done; False if the handle had already finished."""
        with self._lock:
            if self._done.is_set():
                return False
            self._error = error
            self._done.set()
            return True

    def poll(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TransferTimeout(
                f"{self.what} ({self._nbytes} B) not complete after {timeout} s; "
                "the peer is slow or stalled — wait again, or drop the peer"
            )
        if self._error is not None:
            raise self._error

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None
