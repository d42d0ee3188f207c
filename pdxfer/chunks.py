"""What the prefill pushes: one request's chunks turned into posted transfers.

The arithmetic between a `send()` and the transport lives here, apart from
the engine's sockets and timers: a chunk's source indices are mapped onto the
next positions of the decode's destination list (one cursor per pool),
checked whole before anything is posted — so a refusal leaves the request
as it was — planned pool by pool through the routes built at handshake time,
and posted one transfer per pool, each with its `Landed` notify.

Streamed sends (`send(layers=(a, b))`, #33) live here too: the layer ranges of
one set of entries form a *span* — they name the same entries, run in order
from layer 0 to the pools' depth, and agree on `last` and `checkpoint` — and
the destination cursors move only once a span's last layer is sent, so every
range of it lands in the same destinations. `span_of` checks a range against
the span in progress before anything changes; each chunk's notify names its
span and layers, which is what the decode's proof is kept over.

Also here: the records the prefill keeps (`PrefillRequest`, `DecodePeer`),
since those are what this arithmetic reads and writes; what a request may do
next is its `lifecycle.PrefillLife`'s business, not theirs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from pdxfer import layout
from pdxfer.transport.base import Connection
from pdxfer.transport.errors import TransportError

from .errors import LayoutError, RequestError
from .lifecycle import PrefillLife
from .pools import PoolSet, Route
from .protocol import MAX_LINKS, landed_payload
from .requests import Request
from .session import ControlConn

_EMPTY = np.empty((0, 3), dtype=np.int64)


class Chunk:
    """One `send()`: source indices per pool, whether it is the last, whether a checkpoint.

    `layers`: the layer range `(a, b)` it carries of its entries, None for
    every layer; `span` and `completes` are set by `span_of` (`last` then
    means the request's last chunk: the last range of its last entries).
    """

    __slots__ = ("checkpoint", "completes", "indices", "last", "layers", "parts", "ready", "span")

    def __init__(self, indices: dict[str, np.ndarray], last: bool, checkpoint: bool,
                 ready: dict | None = None, layers: tuple[int, int] | None = None) -> None:
        self.indices, self.last, self.checkpoint = indices, last, checkpoint
        self.layers = layers
        self.span = 0
        self.completes = True  # its entries' last layer is in it: the cursors move past them
        self.parts: list | None = None  # planned at send() when it posts at once
        # CUDA region -> the event its bytes wait for, captured on the caller's
        # thread at send() (`PoolSet.readiness`): posting may happen later, elsewhere.
        self.ready = ready or {}


class Stream:
    """The span in progress: its entries, the next layer due, and what every range must repeat."""

    __slots__ = ("checkpoint", "indices", "last", "next")

    def __init__(self, indices: dict[str, np.ndarray], nxt: int, last: bool, checkpoint: bool) -> None:
        self.indices, self.next, self.last, self.checkpoint = indices, nxt, last, checkpoint


def check_layer_range(rid: str, layers: Any, depth: int) -> tuple[int, int] | None:
    """`send()`'s `layers` as `(a, b)`, None for every layer, or the refusal naming it.

    `depth` is the pools' deepest field (`PoolSet.depth`); `(0, depth)` is
    every layer, the same as None.
    """
    if layers is None:
        return None
    try:
        a, b = layers
        ok = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (a, b))
    except (TypeError, ValueError):
        ok = False
    if not ok or not 0 <= a < b <= depth:
        raise RequestError(
            f"send({rid!r}): layers must be a pair (a, b) of ints with 0 <= a < b <= {depth} "
            f"(the deepest field of this engine's pools), got {layers!r:.80}; nothing was sent"
        )
    return None if (a, b) == (0, depth) else (int(a), int(b))


def _same_entries(x: dict[str, np.ndarray], y: dict[str, np.ndarray]) -> bool:
    return x.keys() == y.keys() and all(np.array_equal(x[p], y[p]) for p in x)


def span_of(rid: str, stream: Stream | None, spans: int, chunk: Chunk, depth: int) -> None:
    """Place `chunk` in its request's spans (sets `span`, `completes`, `last`), or refuse it.

    Pure with respect to the request: a `RequestError` here leaves it as it
    was; `commit_span` records the chunk once it was accepted.
    """
    if chunk.layers is None:
        if stream is not None:
            raise RequestError(
                f"send({rid!r}): layers [0, {stream.next}) of its streamed entries are sent and "
                f"layers [{stream.next}, {depth}) are not; send layers ({stream.next}, b) of the "
                "same entries up to the last layer before another chunk"
            )
        chunk.span, chunk.completes = spans, True
        return
    a, b = chunk.layers
    if stream is None:
        if a != 0:
            raise RequestError(
                f"send({rid!r}): layers ({a}, {b}) start a new set of entries, which streams "
                f"from layer 0; send layers (0, {a}) of them first"
            )
    else:
        if a != stream.next:
            raise RequestError(
                f"send({rid!r}): layers ({a}, {b}) do not continue its streamed entries: layers "
                f"[0, {stream.next}) are sent; send layers ({stream.next}, b) next, in order"
            )
        if not _same_entries(stream.indices, chunk.indices):
            raise RequestError(
                f"send({rid!r}): layers ({a}, {b}) name other entries than the ranges before "
                f"them; every layer range of a set of entries names the same pools and indices "
                f"until layer {depth}"
            )
        if (stream.last, stream.checkpoint) != (chunk.last, chunk.checkpoint):
            raise RequestError(
                f"send({rid!r}): layers ({a}, {b}) say last={chunk.last}, "
                f"checkpoint={chunk.checkpoint}, the ranges before them last={stream.last}, "
                f"checkpoint={stream.checkpoint}; every range of a set of entries says the same"
            )
    chunk.span, chunk.completes = spans, b == depth
    chunk.last = chunk.last and chunk.completes


def commit_span(req: PrefillRequest, chunk: Chunk, last: bool) -> None:
    """An accepted chunk moves its request's span: opens, continues or closes the stream.

    `last`: what the caller said (a range before its entries' last layer is not the request's
    last chunk, but every range of the span must say the same).
    """
    if chunk.completes:
        req.stream = None
        req.spans += 1
    elif req.stream is None:
        req.stream = Stream(chunk.indices, chunk.layers[1], last, chunk.checkpoint)
    else:
        req.stream.next = chunk.layers[1]


class PrefillRequest(Request):
    """A request as the prefill tracks it: the decode's destinations, cursors, posted handles."""

    __slots__ = ("cursor", "dst", "handles", "links", "next_chunk", "session", "skip", "sources",
                 "spans", "stream")

    def __init__(self, request_id: str, life: PrefillLife) -> None:
        super().__init__(request_id, life)
        self.session: DecodePeer | None = None
        self.dst: dict[str, np.ndarray] | None = None  # from the decode's Expect
        self.cursor: dict[str, int] = {}
        # Per pool, how many of the entries sent are still to be skipped: the decode holds
        # them already (a tail-only Expect's `offsets`); counted down across chunks.
        self.skip: dict[str, int] = {}
        self.next_chunk = 0
        self.handles: list[Any] = []
        self.sources: list[dict[str, np.ndarray]] = []  # every accepted chunk's, until finished
        self.links: set[str] = set()  # incarnations of the data links its transfers were posted on
        self.stream: Stream | None = None  # the span whose layers are being streamed (`span_of`)
        self.spans = 0  # spans accepted whole: the next span's number

    def held(self, pool: str) -> list[np.ndarray]:
        """Our entries of `pool` this request's transfers may still read (`resizing.blocking`)."""
        return [c[pool] for c in self.sources if pool in c]


class DecodePeer:
    """One connected decode engine, as this prefill sees it.

    `conn` is None until the handshake worker (`handshake.DataLinks`) has
    opened and warmed the data connection, and again from a fence or a cut
    until it has reopened it; `epoch` names the current attempt.
    """

    __slots__ = ("address", "conn", "empty", "engine", "epoch", "link", "opening", "requests",
                 "routes", "warm", "welcomed")

    def __init__(self, link: ControlConn, engine: str, address: dict, routes: dict[str, Route]) -> None:
        self.link, self.engine, self.address, self.routes = link, engine, address, routes
        self.conn: Any = None
        self.epoch = 0
        self.opening = False
        self.welcomed = False
        self.requests: set[str] = set()
        first = next(r.groups[0] for r in routes.values() if r.groups)
        # A chunk with nothing to move still needs its notify: an empty table does that.
        self.empty = (first[0], first[1], _EMPTY)
        # Every (local region, remote descriptor) pair a post may use: warmed at handshake.
        seen: dict[Any, tuple[Any, dict]] = {}
        for route in routes.values():
            for region, remote, *_ in route.groups:
                seen.setdefault(id(remote), (region, remote))  # one dict per remote region
        self.warm = list(seen.values())

    @property
    def ready(self) -> bool:
        return self.conn is not None and getattr(self.conn, "alive", True)


def closed_links(req: PrefillRequest) -> list[str]:
    """The data links `req` posted on that are no longer its peer's live one (`Abort.links`).

    A transfer on the live link either completed (its bytes landed before the
    ack) or failed before anything was sent (a refused write leaves the link
    up); one on a link that was closed or died may have left bytes in flight
    there, which the decode must see settle before it frees the entries. A
    link the transport cannot name is "" (the decode then waits for all).
    """
    session = req.session
    live = session.conn.incarnation if session is not None and session.ready else None
    names = sorted(req.links - {live})
    return names if len(names) <= MAX_LINKS else [""]


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
    dst, cursor, skip = req.dst, req.cursor, req.skip
    assert session is not None and dst is not None
    moves, skipped = [], {}
    for pool, src in chunk.indices.items():
        k = skip.get(pool, 0)
        if k:  # the decode holds these already (a tail-only Expect): ship what follows them
            skipped[pool] = min(k, len(src))
            src = src[skipped[pool]:]
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
            short = skip.get(pool, 0) - skipped.get(pool, 0)
            if short:
                raise RequestError(
                    f"request {req.id!r}: the decode holds the first {skip[pool]} entries of "
                    f"pool {pool!r} already (its Expect's offset), but this prefill sends only "
                    f"{skip[pool] - short} in all; a bad offset — have the decode expect the "
                    "whole tail with a smaller offset"
                )
            sent = cursor[pool] + len(chunk.indices.get(pool, ())) - skipped.get(pool, 0)
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
        parts += session.routes[pool].plan(src, d, chunk.checkpoint, chunk.layers)
    if not chunk.completes:  # a layer range before its entries' last: the next range fills
        return parts or [session.empty]  # the same destinations, so no cursor moves yet
    for pool, src, _ in moves:
        cursor[pool] += len(src)
    for pool, k in skipped.items():
        skip[pool] -= k
    if not parts:
        parts = [session.empty]
    return parts


def post_parts(req: PrefillRequest, parts: list[tuple[Any, dict, np.ndarray]], last: bool,
               conn: Connection, ready: dict | None = None, note: Any = None,
               layers: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Post the chunk's transfers, each carrying its `Landed` notify; raises `TransportError`.

    `note(req, event, detail)`: told of each write posted (the request's trace).
    `layers`: `(span, lo, hi)` the notify names (`hi == 0`: every layer).
    """
    span, lo, hi = layers
    number = req.next_chunk
    req.next_chunk += 1
    if req.wire_from is None:
        req.wire_from = time.monotonic()
    total = len(parts)
    req.links.add(conn.incarnation or "")
    for i, (region, remote, table) in enumerate(parts):
        proof = getattr(table, "proof", None)  # a CheckedTable knows its bytes
        nbytes = proof[2] if proof is not None else int(np.add.reduce(table[:, 2]))
        notify = landed_payload(req.id, req.life.xid, number, i, total, last, nbytes, len(table),
                                span, lo, hi)
        req.handles.append(conn.write(region, remote, table, notify,
                                      ready=ready.get(region) if ready else None))
        req.nbytes += nbytes
        req.segments += len(table)
        req.transfers += 1
        if note is not None:
            note(req, "posted", ("chunk={} part={}/{} bytes={} segments={}", number, i, total,
                                 nbytes, len(table)))


def note_wire_end(req: PrefillRequest) -> None:
    """Before dropping its handles: the request's wire time ends at its last completion."""
    if req.handles:
        ends = [getattr(h, "done_at", None) for h in req.handles]
        req.wire_to = max((t for t in ends if t is not None), default=time.monotonic())


def transfer_error(req: PrefillRequest) -> TransportError | None:
    """The first failed transfer's error; drops the handles once every one completed."""
    if not req.handles:
        return None
    try:
        running = False
        for h in req.handles:
            running = not h.poll() or running
        if not running:
            note_wire_end(req)
            req.handles = []
    except TransportError as exc:
        return exc
    return None
