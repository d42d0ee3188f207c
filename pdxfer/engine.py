"""What a prefill and a decode engine share: construction, the request reads, close.

Both sides own the same tree of resources — a transport engine, the pools
registered with it, a request table, one progress thread — and answer the same
non-blocking questions about a request (`poll`, `failure_reason`, `stats`) and
the same blocking one (`wait`). Those live here once; what differs (who
listens, who dials, who posts, who fences) is in `prefill.py` and `decode.py`.

Lock discipline, the one rule that keeps this deadlock-free: the table's lock
guards request state and may be held while posting a write or connecting
(the hot path; both take only the transport's own locks) or while sending on
a control link (non-blocking), but never while calling a transport method
that waits for another thread — `drop_peer`, `Connection.close`, `close`.
Those run with the lock released, because the thread they wait for (a
loopback copy worker, say) may need *our* lock to deliver a notify before it
lets such a call return.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pdxfer import transport

from .config import EngineConfig, KVPoll, RequestStats
from .errors import ClosedError, ConfigError, RequestFailed
from .pools import PoolSet
from .progress import Progress
from .requests import RequestTable, check_request_id

# How long close() waits for the progress thread to finish its last turn.
_JOIN_TIMEOUT = 5.0


class Engine:
    """Base of `PrefillEngine` and `DecodeEngine`; not constructed directly."""

    role = "engine"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        options = {"host": config.host, **config.transport_options}
        self._transport = transport.create(config.transport, **options)
        self._closed = False
        try:
            self._pools = PoolSet(pools, self._transport)
            self._table = RequestTable(self.role)
            self._lock = self._table.lock
            self._progress = Progress(f"pdxfer-{self.role}-{self._transport.engine_id}", self._tick)
        except BaseException:
            self._transport.close()
            raise

    # -- identity -----------------------------------------------------------
    @property
    def engine_id(self) -> str:
        """This engine's transport id: what peers see in descriptors and fence with."""
        return self._transport.engine_id

    @property
    def regions(self) -> int:
        """How many allocations were registered (one per storage, however many pools share it)."""
        return len(self._pools.regions)

    # -- reads, both sides -------------------------------------------------------
    def poll(self, request_id: str) -> KVPoll:
        """Where the request stands, without blocking."""
        return self._table.poll(check_request_id(request_id))

    def wait(self, request_id: str, timeout: float | None = None) -> KVPoll:
        """Block until Success; `RequestFailed` if it failed, `TransferTimeout` past `timeout`."""
        return self._table.wait(check_request_id(request_id), timeout)

    def failure_reason(self, request_id: str) -> str | None:
        """Why the request failed (None while running or after Success)."""
        return self._table.failure_reason(check_request_id(request_id))

    def stats(self, request_id: str) -> RequestStats:
        """Bytes, segments and transfers the request moved, and how long it took."""
        return self._table.stats(check_request_id(request_id))

    def try_poll(self, request_id: str) -> KVPoll | None:
        """`poll`, but None (not `RequestError`) when this engine holds no record of the id.

        For a scheduler loop that polls a request the other side may not have
        announced yet (a prefill sender before the decode's Expect arrives):
        "not yet known" is an answer there, not an error to catch and parse.
        """
        rid = check_request_id(request_id)
        with self._lock:
            req = self._table.find(rid)
            return None if req is None else req.state

    def failure(self, request_id: str) -> RequestFailed | None:
        """The request's failure as the `RequestFailed` `wait` raises (cause attached), or None.

        Lets a caller raise or log the failure without blocking in `wait` and
        without the engine's private cause types: `raise engine.failure(rid)`.
        """
        rid = check_request_id(request_id)
        with self._lock:
            req = self._table.get(rid)
            if req.state is not KVPoll.Failed:
                return None
            exc = RequestFailed(rid, req.reason or "failed")
            exc.__cause__ = req.error
            return exc

    def release(self, request_id: str) -> None:
        """Forget a finished request so its id can be used again."""
        self._table.release(check_request_id(request_id))

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        """Raise `ClosedError` after close(); caller holds the lock."""
        if self._closed:
            raise ClosedError(f"{self.role} engine {self.engine_id} is closed")

    def close(self) -> None:
        """Fail what is in flight, stop the thread, release the transport. Idempotent, bounded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._shutdown()
        finally:
            self._progress.stop(_JOIN_TIMEOUT)
            self._transport.close()
            reason = f"{self.role} engine closed"
            with self._lock:
                for req in self._table.running():
                    self._table.finish(req, False, reason, ClosedError(reason))

    def _shutdown(self) -> None:
        """Role-specific part of close(), run before the thread stops."""

    def _tick(self, now: float) -> float:
        """Timers; returns seconds until the next wanted tick."""
        return 0.1

    def _run_on_progress(self, fn: Any, timeout: float) -> None:
        """Run `fn()` on the progress thread and wait (bounded) for it to finish."""
        done = threading.Event()

        def job() -> None:
            try:
                fn()
            finally:
                done.set()

        self._progress.call(job)
        done.wait(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

