"""What the decode receives into: its records and the checks an `expect()` runs up front.

The counterpart of `chunks.py`: the records the decode keeps
(`DecodeRequest`, `PrefillPeer`) and the validation that turns an
`expect()`'s indices into the `Expect` message — every index checked, the
frame's size bounded — before anything is recorded, so a refused call
leaves no trace and a message that could not be framed is never queued
behind other requests. What a request may do next is its
`lifecycle.DecodeLife`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pdxfer import layout

from .directory.records import PeerRecord
from .errors import RequestError
from .lifecycle import DecodeLife
from .pools import PoolSet
from .protocol import MAX_FRAME, Expect, pack_indices
from .requests import Request
from .session import ControlConn

# An Expect carries 8 B per index in one control frame; keep well inside its limit.
MAX_INDICES = (MAX_FRAME - (64 << 10)) // 8


class DecodeRequest(Request):
    """A request as the decode tracks it: its destinations and the prefill serving it."""

    __slots__ = ("due", "dst", "record", "rebound", "session")

    def __init__(self, request_id: str, life: DecodeLife, dst: dict[str, np.ndarray],
                 record: PeerRecord) -> None:
        super().__init__(request_id, life)
        self.dst = dst
        self.record = record  # who should serve it: an address, or a directory record
        self.peer = record.address
        self.rebound = False  # re-resolved once already (bounds re-resolution to one hop)
        self.session: PrefillPeer | None = None
        self.due = math.inf  # its live entry in the decode's deadline heap (`DecodeEngine._schedule`)

    def held(self, pool: str) -> list[np.ndarray]:
        """Our entries of `pool` this request may still receive into (`resizing.blocking`)."""
        dst = self.dst.get(pool)
        return [] if dst is None else [dst]


class PrefillPeer:
    """One prefill engine as this decode sees it, keyed by its bootstrap address.

    Until its control link first connects, the decode keeps dialling it until
    `connect_by` (`decode_dials`): `attempts` so far, `retry_at` the next,
    `resolving` while its host name is being looked up, `why_not` what the
    last attempt ran into; `retry` False for an address whose prefill was
    reached before and then lost (not redialled: it is gone).
    """

    __slots__ = ("addr", "attempts", "connect_by", "engine", "expected", "link", "ready",
                 "refusal", "requests", "resolving", "retry", "retry_at", "waiting", "why_not")

    def __init__(self, addr: str, expected: str | None, connect_by: float, retry: bool = True) -> None:
        self.addr = addr
        self.connect_by = connect_by
        self.attempts = 0
        self.retry_at: float | None = None
        self.resolving = False
        self.why_not: str | None = None
        self.retry = retry
        self.link: ControlConn | None = None
        self.engine: str | None = None  # the prefill's transport engine id, from Welcome
        self.expected = expected  # the engine id the dialing request's record named (None: any)
        self.ready = False
        self.refusal: tuple[str, str] | None = None
        self.waiting: list[DecodeRequest] = []  # bound before the handshake finished
        self.requests: set[str] = set()  # Expect sent, not yet finished


def expect_message(pools: PoolSet, rid: str, xid: int, indices: Mapping[str, Any],
                   offsets: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, np.ndarray], Expect]:
    """`(destinations per pool, the Expect to send)`, or the refusal naming what was wrong."""
    dst = expect_destinations(pools.arenas, rid, indices)
    skip = expect_offsets(dst, rid, offsets)
    return dst, Expect(rid, xid, {p: pack_indices(a) for p, a in dst.items()}, skip)


def expect_offsets(dst: Mapping[str, np.ndarray], rid: str, offsets: Mapping[str, Any] | None
                   ) -> dict[str, int]:
    """A tail-only Expect's entry offsets, checked: `{pool: k}` for each k > 0.

    `offsets[pool] = k`: the decode already holds (from its prefix cache) the
    first k entries of what the prefill sends in `pool`, and `indices[pool]`
    names the destinations of the entries after them only. Refused by name
    (`RequestError`) before anything is recorded or sent: a pool the Expect
    does not name, a count that is not an int >= 0.
    """
    if offsets is None:
        return {}
    if not isinstance(offsets, Mapping):
        raise RequestError(f"expect({rid!r}): offsets must be a mapping pool -> entries the "
                           f"decode already holds, got {type(offsets).__name__}")
    out = {}
    for pool, k in offsets.items():
        if pool not in dst:
            raise RequestError(f"expect({rid!r}): offset for pool {pool!r}, which this Expect "
                               f"names no destinations in (pools: {sorted(dst)}); name its tail "
                               "(possibly empty) in indices, or drop the offset")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_INDICES << 8:
            raise RequestError(f"expect({rid!r}): pool {pool!r} offset must be an int count of "
                               f"entries the decode already holds, 0..{MAX_INDICES << 8}, got {k!r:.40}")
        if k:
            out[pool] = int(k)
    return out


def expect_destinations(arenas: Mapping[str, Any], rid: str, indices: Mapping[str, Any]
                        ) -> dict[str, np.ndarray]:
    """Every check `expect_message` runs, without framing: for a caller that checks before it commits.

    `tp_group.HeteroTPDecode` asks this for each of its sub-requests before
    the first exists, so a refusal leaves none behind.
    """
    if not isinstance(indices, Mapping) or not indices:
        raise RequestError(f"expect({rid!r}): indices must be a non-empty mapping pool -> indices")
    dst = {}
    for pool, idx in indices.items():
        arena = arenas.get(pool)
        if arena is None:
            raise RequestError(
                f"expect({rid!r}): no pool {pool!r} on this decode; pools: {sorted(arenas)}"
            )
        dst[pool] = layout.check_indices(arena, idx, what=f"pool {pool!r} destination index",
                                         unique=True)
    count = sum(len(a) for a in dst.values())
    if count > MAX_INDICES:
        raise RequestError(
            f"expect({rid!r}): {count} destination entries exceed the {MAX_INDICES} one "
            "request can name; use larger pages or split the request"
        )
    # Refused here if it could not be framed later, on the link other requests
    # share. Bounded rather than framed twice (the progress thread frames it to
    # send): 8 B per index, at most 4 B per character of the id and the pool
    # names, a few bytes of msgpack per item; every field is a str, int or bytes.
    size = 8 * count + 4 * (len(rid) + sum(len(p) for p in dst)) + 16 * len(dst) + 256
    if size > MAX_FRAME:
        raise RequestError(f"expect({rid!r:.80}): its Expect cannot be framed: up to {size} B "
                           f"exceeds the {MAX_FRAME} B control frame limit; use shorter pool names")
    return dst
