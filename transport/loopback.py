"""Two engines in one process; bytes move by plain copies.

Loopback is the reference backend: the PD engine and the conformance suite
run on it without sockets, and it shows what a transfer costs when the wire
is free. It keeps the full contract anyway — asynchronous handles, notify
after data, `drop_peer` as a fence, close failing in-flight work — so code
that works here does not discover those semantics on tcp.

Each connection owns one worker thread that executes its transfers in post
order: validate up front (in `write`, before anything is queued), copy, call
the peer's notify handler, complete the handle. Copies hold the connection's
landing lock; severing the connection (peer `drop_peer`, either engine
closing) takes that lock, so once it returns no further byte lands.

Copies: CPU→CPU tables go to `copying.CopyPool` (one per sending engine),
which merges rows adjacent on both sides into one copy, moves equal-sized
short rows with one vectorised numpy assignment per batch, and shares big
tables between the worker thread and a few helper threads that claim
batches from one list; its module docstring has the measurements behind
each step. A copy in progress always finishes on every thread before the
worker releases the landing lock, so the fence covers helpers too.
Anything involving CUDA memory goes through `device_copy` (a few batched
ops per table) on the connection's own copy stream, after the producer's
`ready` event; the transfer completes once that stream's event says those
copies landed (`transport.streams`) — never a device-wide synchronise.

Deliberately absent: `read` (pull) — nothing needs it yet; a cross-process
mode — that is what tcp is for.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import uuid
import weakref
from typing import Any

import numpy as np
import torch

from .base import (
    Capabilities,
    Connection,
    LocalRegion,
    NotifyHandler,
    TransferHandle,
    TransportEngine,
    forced_fence,
    refuse_fence,
)
from .copying import CopyPool
from .device_copy import copy_rows
from .errors import CapabilityError, ClosedError, PeerLostError, RegistrationError, TransportError
from .handles import Handle
from .regions import Region, RegionTable, check_descriptor
from .segments import as_table, check_notify, check_table
from .streams import CopyStream, capture, cuda_device

log = logging.getLogger(__name__)
# How long close() waits for each thread it started (a copy in flight finishes first).
JOIN_TIMEOUT = 10.0

# Live engines of this process by id: what `connect` resolves an address with.
_ENGINES: weakref.WeakValueDictionary[str, LoopbackEngine] = weakref.WeakValueDictionary()


class _Transfer:
    __slots__ = ("dst", "handle", "notify", "ready", "src", "table")

    def __init__(self, handle: Handle, src: Region, dst: Region, table: np.ndarray,
                 notify: bytes | None, ready: Any) -> None:
        self.handle, self.src, self.dst, self.table, self.notify = handle, src, dst, table, notify
        self.ready = ready


class LoopbackConnection(Connection):
    """A link from one loopback engine to another, with its own ordered worker."""

    def __init__(self, owner: LoopbackEngine, peer: LoopbackEngine) -> None:
        self._owner = owner
        self._peer = peer
        self._cond = threading.Condition()
        self._queue: collections.deque[_Transfer] = collections.deque()
        self._landing = threading.RLock()
        self._error: TransportError | None = None  # set once: the link is dead
        self._ids = itertools.count(1)
        # id(descriptor) -> (descriptor, region, length, backend, engine): see `_remote`.
        self._remotes: dict[int, tuple[Any, ...]] = {}
        self._copy_stream = CopyStream()  # this worker's own CUDA stream(s)
        self._worker = threading.Thread(
            target=self._run, name=f"loopback {owner.engine_id}->{peer.engine_id}", daemon=True
        )
        self._worker.start()

    @property
    def alive(self) -> bool:
        return self._error is None

    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
        *,
        ready: Any = None,
    ) -> TransferHandle:
        if self._error is not None:
            raise self._error
        src = self._owner._regions.local(local)
        region_id, length = self._remote(remote)
        dst = self._peer._regions.get(region_id)
        if dst is None:
            raise RegistrationError(
                f"engine {self._peer.engine_id} has no region {region_id} (never registered "
                "or deregistered); ask the peer for a fresh descriptor"
            )
        if dst.length != length:
            raise RegistrationError(
                f"descriptor says region {region_id} has {length} B but it has {dst.length} B; "
                "the descriptor is stale or was edited"
            )
        if src.device == dst.device == "cuda" and src.data.device != dst.data.device:
            # One copy stream orders one device's work; a peer copy would also
            # run on the other device's current stream (the model's), unordered.
            raise CapabilityError(
                f"loopback copies between two CUDA devices ({src.data.device} -> "
                f"{dst.data.device}) are not supported; register both regions on one device"
            )
        table = as_table(segments)
        nbytes = check_table(table, src.length, dst.length)
        payload = check_notify(notify)
        event = capture(ready, src.data.device)
        handle = Handle(nbytes, f"loopback transfer {next(self._ids)} to {self._peer.engine_id}")
        with self._cond:
            if self._error is not None:
                raise self._error
            self._queue.append(_Transfer(handle, src, dst, table, payload, event))
            self._cond.notify()
        return handle

    def _remote(self, remote: Any) -> tuple[int, int]:
        """`check_descriptor`'s answer for `remote`, checked once per descriptor dict.

        Callers pass a peer's descriptors back unchanged on every write, so
        the check runs once per dict. A hit needs the very dict it was checked
        on (held here, so its id cannot be recycled) still holding the very
        objects it was checked with under every key the check reads; an
        edited dict fails that and is checked afresh, refusal and all.
        """
        hit = self._remotes.get(id(remote))
        if (hit is not None and hit[0] is remote and remote.get("region") is hit[1]
                and remote.get("length") is hit[2] and remote.get("backend") is hit[3]
                and remote.get("engine") is hit[4] and "device" in remote):
            return hit[1], hit[2]
        region_id, length = check_descriptor(remote, "loopback", self._peer.engine_id)
        if type(remote) is dict:  # a subclass could answer `get` differently
            if len(self._remotes) >= 256:  # bounded: a caller minting dicts per write
                self._remotes.clear()
            self._remotes[id(remote)] = (remote, region_id, length, remote["backend"], remote["engine"])
        return region_id, length

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    return
                item = self._queue.popleft()
            try:
                with self._landing:
                    if self._error is not None:
                        item.handle.fail(self._error)
                        return
                    self._owner._move(item.src, item.dst, item.table, item.ready, self._copy_stream)
            except Exception as exc:  # a copy failing is a bug or a device fault
                if self._owner._closed:  # a copy failing during close is reported as the close
                    item.handle.fail(ClosedError(f"{item.handle.what}: engine closed"))
                    return
                item.handle.fail(TransportError(f"{item.handle.what} failed: {exc}"))
                self.sever(TransportError(f"loopback link broken by a failed copy: {exc}"))
                log.exception("loopback copy failed")
                return
            if item.notify is not None:
                # Started under the landing lock: sever() waits a running notify out
                # and none starts after it (re-entrant: the handler may drop_peer).
                with self._landing:
                    if self._error is not None:
                        item.handle.fail(self._error)
                        return
                    self._peer._deliver(self._owner.engine_id, item.notify)
            item.handle.complete()

    def sever(self, error: TransportError) -> None:
        """Kill the link with `error`: queued transfers fail, and no byte lands after return."""
        with self._cond:
            if self._error is None:
                self._error = error
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in pending:
            item.handle.fail(self._error)
        # Waits out a copy in progress: the fence drop_peer promises.
        with self._landing:
            pass

    def close(self) -> None:
        self.sever(ClosedError(f"connection {self._owner.engine_id}->{self._peer.engine_id} closed"))
        self.join(JOIN_TIMEOUT)

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the worker to exit; it does once it sees the link's error.

        Exists so close() leaves no thread of ours inside a copy at interpreter
        exit (a native thread still running there can abort the process). Not
        from the worker itself: a notify handler may close the engine.
        """
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)


class LoopbackEngine(TransportEngine):
    """An engine whose peers are other loopback engines of this process."""

    name = "loopback"
    # accepted so one set of common options fits every backend; no socket to apply them to
    IGNORED_OPTIONS = frozenset({"host", "port", "streams"})
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=True, cross_process=False,
        one_sided=True, notify=True, read=False,
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int | None = None,
        copy_threads: int | None = None,
        connect_timeout: float | None = None,
        *,
        fence: bool = True,
    ) -> None:
        """`fence=False` makes `drop_peer` refuse and `capabilities.fence` False: a test's
        way to run the engine's no-fence (quarantine) path here (`base.forced_fence`)."""
        # host/port/streams/connect_timeout are accepted so callers can pass the
        # common options to any backend; a loopback engine has no socket to
        # apply them to, and its connect never waits.
        del host, port, streams, connect_timeout
        self.capabilities = forced_fence(type(self), fence)
        self.engine_id = f"loopback-{uuid.uuid4().hex[:12]}"
        self._regions = RegionTable(self.name, self.engine_id, cuda=True)
        self._lock = threading.Lock()
        self._outbound: dict[str, LoopbackConnection] = {}
        self._inbound: dict[str, list[LoopbackConnection]] = {}
        self._handler: NotifyHandler | None = None
        self._copier = CopyPool(copy_threads or min(4, os.cpu_count() or 1))
        self._closed = False
        _ENGINES[self.engine_id] = self

    # -- memory -------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        self._check_open()
        return self._regions.register(tensor)

    def deregister(self, region: LocalRegion) -> None:
        self._regions.deregister(region)

    # -- peers --------------------------------------------------------------
    def address(self) -> dict[str, Any]:
        return {"backend": self.name, "engine": self.engine_id}

    def connect(self, peer_address: dict[str, Any]) -> Connection:
        self._check_open()
        if not isinstance(peer_address, dict) or peer_address.get("backend") != self.name:
            raise RegistrationError(
                f"not a loopback address: {peer_address!r}; pass the peer engine's address()"
            )
        peer_id = peer_address.get("engine")
        peer = _ENGINES.get(peer_id) if isinstance(peer_id, str) else None
        if peer is None or peer._closed:
            raise PeerLostError(f"no live loopback engine {peer_id!r} in this process")
        with self._lock:
            conn = self._outbound.get(peer_id)
            if conn is not None and conn.alive:
                return conn
            conn = LoopbackConnection(self, peer)
            self._outbound[peer_id] = conn
        with peer._lock:
            closed = peer._closed
            if not closed:
                links = peer._inbound.setdefault(self.engine_id, [])
                links[:] = [c for c in links if c.alive]
                links.append(conn)
        if closed:
            conn.sever(PeerLostError(f"loopback engine {peer_id} closed"))
        return conn

    def set_notify_handler(self, handler: NotifyHandler | None) -> None:
        self._handler = handler

    def _deliver(self, sender: str, payload: bytes) -> None:
        handler = self._handler
        if handler is None or self._closed:
            return
        try:
            handler(sender, payload)
        except Exception:  # the handler is the caller's code; its bug must not kill the link
            log.exception("notify handler raised for a payload from %s", sender)

    def drop_peer(self, engine_id: str) -> None:
        refuse_fence(self, "it was created with fence=False")
        with self._lock:
            links = self._inbound.pop(engine_id, [])
        for conn in links:
            conn.sever(PeerLostError(f"engine {self.engine_id} dropped peer {engine_id} (fence)"))

    def has_peer(self, engine_id: str) -> bool:
        with self._lock:
            return any(c.alive for c in self._inbound.get(engine_id, ()))

    # -- data movement ------------------------------------------------------
    def _move(self, src: Region, dst: Region, table: np.ndarray, ready: Any,
              stream: CopyStream) -> None:
        if table.shape[0] == 0:
            return
        if src.array is None or dst.array is None:
            # After the producer's event, on this link's copy stream, a few
            # batched ops; returns once exactly those landed (transport.streams).
            stream.run(cuda_device(src.data, dst.data), ready,
                       lambda: copy_rows(src.data, dst.data, table))
            return
        self._copier.copy(src.array, dst.array, table)

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"loopback engine {self.engine_id} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outbound = list(self._outbound.values())
            inbound = [c for links in self._inbound.values() for c in links]
            self._outbound.clear()
            self._inbound.clear()
        _ENGINES.pop(self.engine_id, None)
        for conn in inbound:
            conn.sever(PeerLostError(f"loopback engine {self.engine_id} closed"))
        for conn in outbound:
            conn.close()
        for conn in inbound:
            conn.join(JOIN_TIMEOUT)
        self._copier.close(JOIN_TIMEOUT)
        self._regions.clear()
