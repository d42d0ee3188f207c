"""What the prefill pushes: one request's chunks turned into posted transfers.

The arithmetic between a `send()` and the transport lives here, apart from
the engine's sockets and timers: a chunk's source indices are mapped onto the
next positions of the decode's destination list (one cursor per pool),
checked whole before anything is posted — so a refusal leaves the request
as it was — planned pool by pool through the routes built at handshake time,
and posted one transfer per pool, each with its `Landed` notify.

Also here: the records the prefill keeps (`PrefillRequest`, `DecodePeer`, `Tombstones`),
since those are what this arithmetic reads and writes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pdxfer import layout
from pdxfer.transport.base import Connection
from pdxfer.transport.errors import ClosedError, PeerLostError, TransferTimeout, TransportError

from .config import KVPoll
from .errors import LayoutError, RequestError
from .pools import PoolSet, Route
from .protocol import landed_payload
from .requests import Request
from .session import Link

INF = math.inf
_EMPTY = np.empty((0, 3), dtype=np.int64)


class Chunk:
    """One `send()`: source indices per pool, whether it is the last, whether a checkpoint."""

    __slots__ = ("checkpoint", "indices", "last")

    def __init__(self, indices: dict[str, np.ndarray], last: bool, checkpoint: bool) -> None:
        self.indices, self.last, self.checkpoint = indices, last, checkpoint


class PrefillRequest(Request):
    """A request as the prefill tracks it: destination cursors, queued chunks, handles."""

    __slots__ = ("ack", "cursor", "cut", "dst", "fail_by", "failing", "handles", "last_sent",
                 "local", "next_chunk", "pending", "session")

    def __init__(self, request_id: str, deadline: float) -> None:
        super().__init__(request_id, 0, deadline)
        self.session: DecodePeer | None = None
        self.dst: dict[str, np.ndarray] | None = None  # from the decode's Expect
        self.cursor: dict[str, int] = {}
        self.pending: list[Chunk] = []  # chunks sent before the Expect arrived
        self.next_chunk = 0
        self.last_sent = False
        self.handles: list[Any] = []
        self.local = False  # the local caller has called send() for it
        self.failing: tuple[str, BaseException | None] | None = None
        self.fail_by = INF
        self.ack = False  # decode asked for the abort: answer AbortAck, not Abort
        self.cut = False  # finished by cutting transfers still in flight


class DecodePeer:
    """One connected decode engine, as this prefill sees it."""

    __slots__ = ("address", "conn", "empty", "engine", "link", "requests", "routes")

    def __init__(self, link: Link, engine: str, address: dict, routes: dict[str, Route],
                 conn: Any) -> None:
        self.link, self.engine, self.address, self.routes, self.conn = link, engine, address, routes, conn
        self.requests: set[str] = set()
        first = next(r.groups[0] for r in routes.values() if r.groups)
        # A chunk with nothing to move still needs its notify: an empty table does that.
        self.empty = (first[0], first[1], _EMPTY)


class Tombstones:
    """Why recently forgotten requests failed, for a `send()` that comes late. Bounded."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._reasons: collections.OrderedDict[str, str] = collections.OrderedDict()

    def add(self, rid: str, reason: str) -> None:
        self._reasons[rid] = reason
        self._reasons.move_to_end(rid)
        while len(self._reasons) > self.LIMIT:
            self._reasons.popitem(last=False)

    def pop(self, rid: str, default: str | None = None) -> str | None:
        return self._reasons.pop(rid, default)


def unfinished(handles: list[Any]) -> list[Any]:
    """Handles still in flight; a failed one is finished (it reads no more source bytes)."""
    out = []
    for h in handles:
        try:
            if not h.poll():
                out.append(h)
        except TransportError:
            pass  # failed is finished: it reads no more source bytes
    return out


def chunk_indices(pools: PoolSet, rid: str, indices: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`send()`'s indices as 1-D arrays per known pool, or the refusal."""
    if type(indices) is not dict and not isinstance(indices, Mapping):  # skip the ABC check
        raise RequestError(f"send({rid!r}): indices must be a mapping pool -> indices")
    out = {}
    for pool, idx in indices.items():
        if pool not in pools.arenas:
            raise RequestError(
                f"send({rid!r}): no pool {pool!r} on this prefill; pools: {sorted(pools.arenas)}"
            )
        arr = idx if isinstance(idx, np.ndarray) else np.asarray(idx)
        if arr.ndim != 1:
            raise LayoutError(f"send({rid!r}): pool {pool!r} indices must be 1-D, got shape {arr.shape}")
        out[pool] = arr
    return out


def plan_chunk(req: PrefillRequest, chunk: Chunk, pools: PoolSet) -> list[tuple[Any, dict, np.ndarray]]:
    """The chunk's transfers `(local region, remote descriptor, table)`, cursors advanced.

    Every check runs before the cursors move, so a refusal (`RequestError`,
    `LayoutError`) leaves the request exactly as it was.
    """
    session = req.session
    dst, cursor = req.dst, req.cursor
    assert session is not None and dst is not None
    moves = []
    for pool, src in chunk.indices.items():
        n = len(src)
        have = dst.get(pool)
        if have is None:
            if n:
                raise RequestError(
                    f"request {req.id!r}: decode expects nothing in pool {pool!r}, but this "
                    f"chunk sends {n} entries; have decode expect them, or leave the pool out"
                )
            continue
        start = cursor[pool]
        if start + n > len(have):
            raise RequestError(
                f"request {req.id!r}: pool {pool!r} chunk sends {n} entries but decode "
                f"expects only {len(have) - start} more (of {len(have)})"
            )
        if n:
            moves.append((pool, src, have[start:start + n]))
    if chunk.last:
        for pool, have in dst.items():
            sent = cursor[pool] + len(chunk.indices.get(pool, ()))
            if sent != len(have):
                raise RequestError(
                    f"request {req.id!r}: the last chunk leaves pool {pool!r} with "
                    f"{len(have) - sent} of {len(have)} destination entries unfilled; send "
                    "them, or have decode expect fewer"
                )
    parts = []
    for pool, src, d in moves:
        if pools.narrowed[pool]:
            layout.check_indices(pools.arenas[pool], src, what=f"pool {pool!r} source index")
        parts += session.routes[pool].plan(src, d, chunk.checkpoint)
    for pool, src, _ in moves:
        cursor[pool] += len(src)
    if not parts:
        parts = [session.empty]
    return parts


def post_parts(req: PrefillRequest, parts: list[tuple[Any, dict, np.ndarray]], last: bool,
               conn: Connection) -> None:
    """Post the chunk's transfers, each carrying its `Landed` notify; raises `TransportError`."""
    number = req.next_chunk
    req.next_chunk += 1
    total = len(parts)
    for i, (region, remote, table) in enumerate(parts):
        nbytes = int(np.add.reduce(table[:, 2]))  # not .sum(): skips numpy's Python wrapper
        notify = landed_payload(req.id, req.xid, number, i, total, last, nbytes, len(table))
        req.handles.append(conn.write(region, remote, table, notify))
        req.nbytes += nbytes
        req.segments += len(table)
        req.transfers += 1


def overdue(req: PrefillRequest, now: float, timeout: float) -> tuple[str, BaseException] | None:
    """Why a running request must fail now — a failed transfer, a passed deadline — or None.

    Also drops the handles once every one completed, so a request waiting for
    its Done (or its next chunk) holds nothing.
    """
    if req.handles:
        try:
            running = False
            for h in req.handles:
                running = not h.poll() or running
            if not running:
                req.handles = []
        except TransportError as exc:
            if req.session is not None and isinstance(exc, (PeerLostError, ClosedError)):
                req.session.conn = None  # dead: the next post reconnects
            return f"transfer to decode failed: {exc}", exc
    if req.deadline <= now:
        what = ("no decode expected it" if req.state is KVPoll.Bootstrapping
                else "decode did not confirm the data")
        msg = f"request {req.id!r}: {what} within {timeout} s"
        return msg, TransferTimeout(msg)
    return None
