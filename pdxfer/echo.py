"""The prefill's half of `pdxfer probe`'s data-path check: answering an `Echo`.

A probe dials a prefill as a decode would; once welcomed, it asks for one
write over the data connection the prefill opened to it — the direction
every request's bytes go. The prefill answers with bytes it can vouch for:
a pattern buffer of its own (`protocol.echo_pattern`), never its pools,
whose bytes a running model changes under the write. So the probe can check
every byte, and a serving prefill's caches are only ever read by requests.

The pattern buffer is registered on the first Echo (a prefill nobody probes
pins nothing for it) and kept until the transport closes; it grows, never
past `protocol.MAX_ECHO`, when a later probe asks for more and none is in
flight. Posting is local work on the progress thread; the wait for the
write's completion runs on a worker (bounded by the connect wait), which
hands `EchoDone` back to the progress thread to send.

Deliberately absent: any effect on requests. An Echo shares the decode's data
connection with its requests (a probe is not a serving decode, but nothing
stops one from echoing) and is written to the region the Echo names, at
offset 0: the decode's own memory, which it offered for exactly this.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .protocol import MAX_ECHO, Echo, EchoDone, echo_pattern
from .workers import Workers


class EchoServer(Workers):
    """Answers a connected decode's `Echo` with a write of the pattern (see the module docstring)."""

    def __init__(self, transport: Any, progress: Any, wait: float, name: str) -> None:
        super().__init__(name)
        self._transport = transport
        self._progress = progress
        self._wait = wait
        self._region: Any = None
        self._in_flight = 0

    def answer(self, session: Any, msg: Echo) -> None:
        """Post the write `msg` asks for on `session`'s data connection, or answer why not (progress thread)."""
        link = session.link
        try:
            handle, posted = self._post(session, msg)
        except Exception as exc:  # noqa: BLE001 — every refusal is the probe's answer, not ours
            link.send(EchoDone(msg.xid, msg.nbytes, False, str(exc), 0.0))
            return
        self._in_flight += 1
        self._spawn(self._finish, link, msg, handle, posted)

    def _post(self, session: Any, msg: Echo) -> tuple[Any, float]:
        n = msg.nbytes
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_ECHO:
            raise ValueError(f"echo of {n!r} B refused: it must be 1..{MAX_ECHO} B")
        if session.conn is None:
            raise ConnectionError("this prefill's data connection to the decode is not open "
                                  "(reopening after a fence or a loss); probe again")
        remote = next((r for _, r in session.warm if r.get("region") == msg.region), None)
        if remote is None:
            raise ValueError(f"region {msg.region!r} is not one of the decode's pool regions")
        if type(remote.get("length")) is int and n > remote["length"]:
            raise ValueError(f"echo of {n} B does not fit the decode's region {msg.region} "
                             f"({remote['length']} B)")
        source = self._source(n)
        posted = time.monotonic()
        table = np.array([[0, 0, n]], dtype=np.int64)
        return session.conn.write(source, remote, table), posted

    def _source(self, n: int) -> Any:
        """The registered pattern buffer, at least `n` B (registered or grown here)."""
        if self._region is not None and self._region.length >= n:
            return self._region
        if self._in_flight:
            raise RuntimeError("another echo is in flight; probe again")
        if self._region is not None:
            self._transport.deregister(self._region)
            self._region = None
        size = min(MAX_ECHO, max(n, 64 << 10))
        self._region = self._transport.register(torch.from_numpy(echo_pattern(size)))
        return self._region

    def _finish(self, link: Any, msg: Echo, handle: Any, posted: float) -> None:
        """Worker: wait for the write (bounded), then send the answer from the progress thread."""
        try:
            handle.wait(self._wait)
            done = EchoDone(msg.xid, msg.nbytes, True, "", (handle.done_at or time.monotonic()) - posted)
        except Exception as exc:  # noqa: BLE001 — a failed or stuck write is the probe's answer
            done = EchoDone(msg.xid, msg.nbytes, False, f"{type(exc).__name__}: {exc}", 0.0)
        self._progress.call(self._send, link, done)

    def _send(self, link: Any, done: EchoDone) -> None:
        self._in_flight -= 1
        if not link.closed:
            link.send(done)
