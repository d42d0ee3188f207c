"""The transfer handle every backend returns: a done flag, an error slot, a byte count.

Completion and failure are set exactly once, from whichever backend thread
learns first (the data mover, an ack reader, a close); later attempts are
ignored, so a transfer that completed is never turned into a failure by a
close that races it. Waiting is an `Event.wait` — no polling loop.

A handle is made per write and most are only polled (the PD engine never
waits on one), while a `threading.Event` and a lock cost microseconds to
build: so the flag is a plain attribute, the event is made by the first
`wait` that finds the transfer running, and one module-wide lock orders the
two (held for a few attribute reads and writes, never while waiting).
"""

from __future__ import annotations

import threading
import time

from .base import TransferHandle
from .errors import TransferTimeout, TransportError, again

_GUARD = threading.Lock()


class Handle(TransferHandle):
    """A posted transfer; `wait()` returns once every byte is in the peer's memory."""

    __slots__ = ("_done", "_error", "_event", "_nbytes", "done_at", "what")

    def __init__(self, nbytes: int, what: str) -> None:
        self._nbytes = nbytes
        self.what = what  # e.g. "tcp transfer 7 to engine ab12" — for error messages
        self._done = False
        self._error: TransportError | None = None
        self._event: threading.Event | None = None  # made by the first wait that blocks
        # `time.monotonic()` when it finished: a transfer's wire time ends here, not when a
        # poll happened to notice (the PD engine's `RequestStats.wire_s`).
        self.done_at: float | None = None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _finish(self, error: TransportError | None) -> bool:
        with _GUARD:
            if self._done:
                return False
            self._error = error  # before the flag: a poll that sees done sees the error
            self.done_at = time.monotonic()
            self._done = True
            event = self._event
        if event is not None:
            event.set()
        return True

    def complete(self) -> bool:
        """Mark done; False if the handle had already finished (either way)."""
        return self._finish(None)

    def fail(self, error: TransportError) -> bool:
        """Record `error` and mark done; False if the handle had already finished."""
        return self._finish(error)

    def poll(self) -> bool:
        if not self._done:
            return False
        if self._error is not None:
            raise again(self._error)
        return True

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            with _GUARD:  # either _finish sees this event, or we see it done
                event = None if self._done else self._event
                if event is None and not self._done:
                    event = self._event = threading.Event()
            if event is not None and not event.wait(timeout):
                raise TransferTimeout(
                    f"{self.what} ({self._nbytes} B) not complete after {timeout} s; "
                    "the peer is slow or stalled — wait again, or drop the peer"
                )
        if self._error is not None:
            raise again(self._error)

    @property
    def failed(self) -> bool:
        return self._done and self._error is not None
