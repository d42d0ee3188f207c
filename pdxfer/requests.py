"""The request table every public call reads, and the records it holds.

One `RequestTable` per engine holds every request the engine has not been
told to forget, under one lock whose condition variable is what `wait()`
sleeps on — no polling loop anywhere. The rules it enforces are the contract
a serving worker relies on:

- States move forward only: Bootstrapping → WaitingForInput → Transferring,
  and from any of those to exactly one of Success or Failed, which are final.
- A finished request keeps its reason (and the exception that caused it) until
  `release()`; an unknown id is a `RequestError`, never a silent default.
- An id in use (running or finished-but-unreleased) cannot be added again.

What a request may do next is decided by its state machine
(`lifecycle.PrefillLife`/`DecodeLife`), held in `Request.life`; the table
only mirrors its caller-visible `KVPoll` and its final outcome, and the
role-specific bookkeeping (chunk cursors, handles) lives in subclasses of
`Request` in `chunks.py`/`expects.py`.

Records the local caller never created (a prefill's record made by a
decode's Expect) are not kept forever once they fail: they become a bounded
tombstone holding the final `RequestOutcome`, which `poll`, `outcome` and a
late `send()` still answer from — an aborted request reads as Failed with
its reason, never as "unknown".
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .config import KVPoll, RequestStats
from .errors import RequestError, RequestFailed, TransferTimeout, UnknownRequestError

# Ids cross the wire in every control message and notify: a bound keeps one
# request from making a frame that cannot be sent (and so failing others).
MAX_ID_BYTES = 1024


@dataclass(frozen=True)
class RequestOutcome:
    """One consistent snapshot of a request: state, why it failed, its cause, its stats.

    Read together under the table lock, so a caller need not race `release()`
    between `poll()`, `failure_reason()` and `stats()`; `release()` returns
    the final one.
    """

    state: KVPoll
    reason: str | None
    cause: BaseException | None
    stats: RequestStats


class Request:
    """What both sides track about one request. Mutated only under the table's lock."""

    __slots__ = ("ended", "error", "id", "life", "nbytes", "peer", "reason", "segments",
                 "started", "state", "trace", "transfers", "wire_from", "wire_to")

    def __init__(self, request_id: str, life: Any) -> None:
        self.id = request_id
        self.life = life  # the request's state machine (lifecycle.py)
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self.nbytes = 0
        self.segments = 0
        self.transfers = 0
        self.peer: str | None = None  # the session key of the other side, once known
        # The wire time's ends (`RequestStats.wire_s`), set by the drivers; None until then.
        self.wire_from: float | None = None
        self.wire_to: float | None = None
        # Its timeline (`observe.Observer.event`): (monotonic time, event, detail); None: off.
        self.trace: list | None = None

    @property
    def finished(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def stats(self) -> RequestStats:
        now = time.monotonic()
        end = self.ended if self.ended is not None else now
        wire = 0.0
        if self.wire_from is not None:
            wire = max(0.0, (self.wire_to if self.wire_to is not None else end) - self.wire_from)
        return RequestStats(self.nbytes, self.segments, self.transfers, end - self.started, wire)

    def outcome(self) -> RequestOutcome:
        return RequestOutcome(self.state, self.reason, self.error, self.stats())


def check_request_id(request_id: object) -> str:
    """The id if it can cross the wire, else `RequestError` naming the limit.

    Checked at every public entry so a bad id fails its own call, before any
    message is built: a 5 MiB id or a lone surrogate would otherwise fail
    while framing a message other requests share.
    """
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request ids must be non-empty str, got {request_id!r:.80}")
    if len(request_id) > MAX_ID_BYTES:
        raise RequestError(
            f"request id of {len(request_id)} characters exceeds the {MAX_ID_BYTES}-byte limit "
            "(UTF-8); use a shorter id"
        )
    try:
        size = len(request_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"request id {request_id!r:.80} is not valid UTF-8 ({exc.reason} at {exc.start}); "
            "ids cross the wire as msgpack str — use printable text"
        ) from None
    if size > MAX_ID_BYTES:
        raise RequestError(
            f"request id of {size} UTF-8 bytes exceeds the {MAX_ID_BYTES}-byte limit; use a shorter id"
        )
    return request_id


class Tombstones:
    """Final outcomes of forgotten records, for a late `send()` or `poll()`. Bounded."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, RequestOutcome] = collections.OrderedDict()

    def add(self, rid: str, outcome: RequestOutcome) -> None:
        self._items[rid] = outcome
        self._items.move_to_end(rid)
        while len(self._items) > self.LIMIT:
            self._items.popitem(last=False)

    def get(self, rid: str) -> RequestOutcome | None:
        return self._items.get(rid)

    def pop(self, rid: str) -> RequestOutcome | None:
        return self._items.pop(rid, None)


class RequestTable:
    """Every live or finished-unreleased request of one engine, and the lock guarding them."""

    def __init__(self, role: str, observer: Any = None) -> None:
        self.role = role
        # Told of every state change below (`observe.Observer`): metrics and traces are
        # counted here, where the changes happen, and nowhere else.
        self.observer = observer
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._requests: dict[str, Request] = {}
        self.tombstones = Tombstones()
        # Ids the local caller released before any peer asked for them (`release(keep=)`):
        # a peer that asks later is answered at once, not taken as a new use (#30.5, #31.3).
        self.released = Tombstones()

    # -- lookups (caller holds the lock) -------------------------------------
    def find(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(
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
        if self.observer is not None:
            self.observer.on_added(req)

    def counts(self) -> dict[KVPoll, int]:
        """How many records are in each state (lock held)."""
        out: dict[KVPoll, int] = {}
        for req in self._requests.values():
            out[req.state] = out.get(req.state, 0) + 1
        return out

    def advance(self, req: Request, state: KVPoll) -> None:
        """Move a running request forward (never back, never out of a final state)."""
        if not req.finished and state > req.state:
            req.state = state
            self.changed.notify_all()
            if self.observer is not None and req.state is not KVPoll.Quarantined:
                self.observer.on_state(req, state)

    def quarantine(self, req: Request, reason: str, error: BaseException | None) -> None:
        """Failed but not finished: its entries may still be written (no fence); shows why."""
        if not req.finished:
            req.state, req.reason, req.error = KVPoll.Quarantined, reason, error
            self.changed.notify_all()
            if self.observer is not None:
                self.observer.on_quarantined(req, reason)

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
        if self.observer is not None:
            self.observer.on_finished(req)
        return True

    def bury(self, req: Request) -> None:
        """Forget a finished record the caller never created, keeping its outcome (bounded)."""
        if self._requests.get(req.id) is req:
            del self._requests[req.id]
            self.tombstones.add(req.id, req.outcome())

    # -- the public reads (take the lock themselves) ---------------------------
    def outcome(self, request_id: str) -> RequestOutcome:
        """The request's snapshot; a buried one answers from its tombstone."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is not None:
                return req.outcome()
            tomb = self.tombstones.get(request_id)
            if tomb is not None:
                return tomb
            self.get(request_id)  # raises UnknownRequestError
            raise AssertionError("unreachable")

    def poll(self, request_id: str) -> KVPoll:
        return self.outcome(request_id).state

    def failure_reason(self, request_id: str) -> str | None:
        return self.outcome(request_id).reason

    def stats(self, request_id: str) -> RequestStats:
        return self.outcome(request_id).stats

    def release(self, request_id: str, keep: Any = None) -> RequestOutcome:
        """Forget a finished request; `keep(req)` True also remembers it in `released` (bounded)."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                tomb = self.tombstones.pop(request_id)
                if tomb is not None:
                    return tomb
                req = self.get(request_id)
            if not req.finished:
                raise RequestError(
                    f"request {request_id!r} is still {req.state.name}; abort() it and wait "
                    "for Failed before release()"
                )
            del self._requests[request_id]
            outcome = req.outcome()
            if keep is not None and keep(req):
                self.released.add(request_id, outcome)
            return outcome

    def wait(self, request_id: str, timeout: float | None) -> KVPoll:
        """Block until the request finishes: Success, `RequestFailed`, or `TransferTimeout`."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                tomb = self.tombstones.get(request_id)
                if tomb is not None:
                    raise RequestFailed(request_id, tomb.reason or "failed") from tomb.cause
                req = self.get(request_id)
            if not self.changed.wait_for(lambda: req.finished, timeout):
                raise TransferTimeout(
                    f"request {request_id!r} still {req.state.name} after {timeout} s; "
                    "wait again, or abort() it"
                )
            if req.state is KVPoll.Failed:
                raise RequestFailed(request_id, req.reason or "failed") from req.error
            return req.state
