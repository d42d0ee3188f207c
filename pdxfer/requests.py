"""The request state machine and the table every public call reads it from.

One `RequestTable` per engine holds every request the engine has not been
told to forget, under one lock whose condition variable is what `wait()`
sleeps on — no polling loop anywhere. The rules it enforces are the contract
a serving worker relies on:

- States move forward only: Bootstrapping → WaitingForInput → Transferring,
  and from any of those to exactly one of Success or Failed, which are final.
- A finished request keeps its reason (and the exception that caused it) until
  `release()`; an unknown id is a `RequestError`, never a silent default.
- An id in use (running or finished-but-unreleased) cannot be added again.

Role-specific bookkeeping (chunk cursors on prefill, landed parts on decode)
lives in subclasses of `Request` in `outbound.py`/`decode.py`; this module
knows only what both sides share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from .config import KVPoll, RequestStats
from .errors import RequestError, RequestFailed, TransferTimeout


class Request:
    """What both sides track about one request. Mutated only under the table's lock."""

    __slots__ = ("id", "xid", "state", "reason", "error", "started", "ended",
                 "deadline", "nbytes", "segments", "transfers", "peer")

    def __init__(self, request_id: str, xid: int, deadline: float) -> None:
        self.id = request_id
        self.xid = xid
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self.deadline = deadline  # monotonic; pushed forward on progress
        self.nbytes = 0
        self.segments = 0
        self.transfers = 0
        self.peer: str | None = None  # the session key of the other side, once known

    @property
    def finished(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def stats(self) -> RequestStats:
        end = self.ended if self.ended is not None else time.monotonic()
        return RequestStats(self.nbytes, self.segments, self.transfers, end - self.started)


def check_request_id(request_id: object) -> str:
    """The id if it is a non-empty str, else `RequestError` (ids cross the wire as msgpack str)."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request ids must be non-empty str, got {request_id!r}")
    return request_id


class RequestTable:
    """Every live or finished-unreleased request of one engine, and the lock guarding them."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._requests: dict[str, Request] = {}

    # -- lookups (caller holds the lock) -------------------------------------
    def find(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise RequestError(
                f"unknown request id {request_id!r} on this {self.role} engine: never "
                "submitted here, or already released"
            )
        return req

    def running(self) -> Iterator[Request]:
        """Unfinished requests, snapshotted so the caller may finish them while iterating."""
        return iter([r for r in self._requests.values() if not r.finished])

    def __len__(self) -> int:
        return len(self._requests)

    # -- transitions (caller holds the lock) ---------------------------------
    def add(self, req: Request) -> None:
        old = self._requests.get(req.id)
        if old is not None:
            raise RequestError(
                f"duplicate request id {req.id!r}: already {old.state.name} on this {self.role} "
                "engine; ids must be unique per engine until release()"
            )
        self._requests[req.id] = req

    def advance(self, req: Request, state: KVPoll) -> None:
        """Move a running request forward (never back, never out of a final state)."""
        if not req.finished and state > req.state:
            req.state = state
            self.changed.notify_all()

    def finish(self, req: Request, ok: bool, reason: str | None = None,
               error: BaseException | None = None) -> bool:
        """Success or Failed, once; False if it had already finished."""
        if req.finished:
            return False
        req.state = KVPoll.Success if ok else KVPoll.Failed
        req.reason = None if ok else (reason or "failed")
        req.error = error
        req.ended = time.monotonic()
        self.changed.notify_all()
        return True

    def forget(self, req: Request) -> None:
        if self._requests.get(req.id) is req:
            del self._requests[req.id]

    # -- the public reads (take the lock themselves) ---------------------------
    def poll(self, request_id: str) -> KVPoll:
        with self.lock:
            return self.get(request_id).state

    def failure_reason(self, request_id: str) -> str | None:
        with self.lock:
            return self.get(request_id).reason

    def stats(self, request_id: str) -> RequestStats:
        with self.lock:
            return self.get(request_id).stats()

    def release(self, request_id: str) -> None:
        with self.lock:
            req = self.get(request_id)
            if not req.finished:
                raise RequestError(
                    f"request {request_id!r} is still {req.state.name}; abort() it and wait "
                    "for Failed before release()"
                )
            del self._requests[request_id]

    def wait(self, request_id: str, timeout: float | None) -> KVPoll:
        """Block until the request finishes: Success, `RequestFailed`, or `TransferTimeout`."""
        with self.lock:
            req = self.get(request_id)
            if not self.changed.wait_for(lambda: req.finished, timeout):
                raise TransferTimeout(
                    f"request {request_id!r} still {req.state.name} after {timeout} s; "
                    "wait again, or abort() it"
                )
            if req.state is KVPoll.Failed:
                raise RequestFailed(request_id, req.reason or "failed") from req.error
            return req.state
