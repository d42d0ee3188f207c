"""Which bytes one prefill rank ships to one decode rank when their TP sizes differ.

A prefill rank p of P and a decode rank q of D hold the head fractions
`[p/P, (p+1)/P)` and `[q/D, (q+1)/D)`; a split field moves exactly their
overlap, which shard-major entries (`layout.shards`) hold as ONE contiguous
range on both sides. Replicated fields (no TP axis) go to decode rank q from
one chosen prefill rank, `replica_source`: the LAST one overlapping q, so its
overlap ends where q's head groups end, the replicated block follows on both
sides and the two ship as one range whenever P >= D. (With P < D only the
decode rank whose heads end where p's end gets that; the others take two.)

So a rank pair's plan is a handful of constant "pieces" per entry, computed
once per pair (`RankPair`), and a request is array arithmetic on them: one
row per (entry, piece), merged where consecutive on both sides, which joins
runs of entries exactly when a piece is a whole slot on both sides (equal
splits, or a replicated-only pool). Which prefill ranks a decode rank needs
(`contributing_ranks`) follows from the same fractions, independent of the
head counts, so every pool of a model agrees on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .describe import split_of
from .errors import LayoutError
from .fields import _require_int
from .runs import _empty, _merge
from .segments import (
    _check_range,
    _check_unique,
    _index_pair,
    _index_space,
    _source_order,
)
from .shards import ShardGeometry, ShardMajorArena


def _sizes(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, int, int]:
    p = _require_int(prefill_tp, "prefill TP size", minimum=1)
    d = _require_int(decode_tp, "decode TP size", minimum=1)
    q = _require_int(decode_rank, "decode TP rank")
    if q >= d:
        raise LayoutError(f"decode TP rank {q} outside 0..{d - 1}")
    return p, d, q


def replica_source(prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """The prefill rank that sends decode rank `decode_rank` its replicated fields.

    Why this one: the last prefill rank overlapping the decode rank's heads, so
    it is already a contributor and its replicated block abuts its head range.
    """
    p, d, q = _sizes(prefill_tp, decode_tp, decode_rank)
    return ((q + 1) * p - 1) // d


def contributing_ranks(
    prefill_tp: int, decode_tp: int, decode_rank: int, *, split: bool = True
) -> list[int]:
    """Prefill ranks decode rank `decode_rank` receives from, ascending.

    Why: a decode rank expects exactly these (one sub-request each). `split`
    is whether the pool has split fields; a replicated-only pool needs just
    `replica_source`, which is one of the overlapping ranks, so a model's
    pools together never add a pair.
    """
    p, d, q = _sizes(prefill_tp, decode_tp, decode_rank)
    if not split:
        return [replica_source(p, d, q)]
    return list(range(q * p // d, -(-(q + 1) * p // d)))


def _unit_pieces(src: ShardGeometry, dst: ShardGeometry, checkpoint: bool) -> list[tuple[int, int, int]]:
    lo, hi = max(src.first_unit, dst.first_unit), min(src.end_unit, dst.end_unit)
    if lo >= hi:
        return []
    s0 = (lo - src.first_unit) * src.unit_bytes
    d0 = (lo - dst.first_unit) * dst.unit_bytes
    if not checkpoint:
        return [(s0, d0, (hi - lo) * src.unit_bytes)]
    return [(s0 + k * src.unit_bytes + off, d0 + k * src.unit_bytes + off, n)
            for k in range(hi - lo) for off, n, carried in src.unit_extents if carried]


def pair_pieces(src: ShardGeometry, dst: ShardGeometry, *, checkpoint: bool = False) -> np.ndarray:
    """`[k, 3]` (src offset, dst offset, bytes) inside one entry, for rank pair src -> dst.

    Why: the per-entry constant every request of the pair repeats; computed
    once. Refuses two geometries of different global formats.
    """
    if src.fields != dst.fields or src.units != dst.units:
        raise LayoutError("rank pair of different global formats; compare them with describe_diff")
    pieces = _unit_pieces(src, dst, checkpoint)
    if src.rank == replica_source(src.tp, dst.tp, dst.rank):
        if checkpoint:
            pieces += [(so, do, n) for (so, n, c), (do, _, _) in
                       zip(src.rep_extents, dst.rep_extents, strict=True) if c]
        elif src.rep_span:
            pieces.append((src.rep_base, dst.rep_base, src.rep_span))
    rows = np.array([p for p in pieces if p[2] > 0], dtype=np.int64).reshape(-1, 3)
    return _merge(rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy()) if rows.size else _empty()


class RankPair:
    """A source shard arena and one peer's split: what every request between them reuses."""

    def __init__(self, arena: ShardMajorArena, peer: dict[str, Any]) -> None:
        dst, self.dst_stride = split_of(peer)
        self.arena, self.dst = arena, dst
        self.pieces = {cp: pair_pieces(arena.geometry, dst, checkpoint=cp) for cp in (False, True)}

    def plan(self, src_idx: object, dst_idx: object, *, dst_entries: int,
             checkpoint: bool = False) -> list[np.ndarray]:
        """One segment table (the arena's one buffer) moving entries `src_idx[k]` -> `dst_idx[k]`.

        Refuses what `plan_segments` refuses, with its words, before planning.
        """
        src, dst = _index_pair(src_idx, dst_idx)
        entries, first_live = _index_space(self.arena)
        dst_entries = _require_int(dst_entries, "dst_entries")
        _check_range(src, first_live, entries, "source index")
        _check_range(dst, 0, dst_entries, "destination index")
        _check_unique(dst, "destination index", dst_entries)
        pieces = self.pieces[bool(checkpoint)]
        if not src.size or not pieces.shape[0]:
            return [_empty()]
        order = _source_order(src, entries)
        if order is not None:
            src, dst = src[order], dst[order]
        s = (src.astype(np.int64)[:, None] * self.arena.slot_stride + pieces[:, 0]).ravel()
        d = (dst.astype(np.int64)[:, None] * self.dst_stride + pieces[:, 1]).ravel()
        return [_merge(s, d, np.tile(pieces[:, 2], src.size))]


def rank_pair(arena: Any, peer: Any) -> RankPair | None:
    """The `RankPair` for shipping from `arena` to a peer described by `peer`, or None.

    Why: a handshake builds it once per (pool, peer). None when the two are
    not shard-major at different splits, i.e. `plan_segments` applies as is.
    """
    if not isinstance(arena, ShardMajorArena) or not isinstance(peer, dict):
        return None
    tp = peer.get("tp")
    if peer.get("kind") != ShardMajorArena.kind or tp == {"size": arena.tp, "rank": arena.rank}:
        return None
    return RankPair(arena, peer)


def plan_rank_pair(src: ShardMajorArena, dst: ShardMajorArena, src_idx: object, dst_idx: object,
                   *, checkpoint: bool = False) -> list[np.ndarray]:
    """`plan_segments` for two local shard arenas at any splits (tests, benchmarks, examples)."""
    from .describe import describe  # the one description, so local and remote plans agree

    return RankPair(src, describe(dst)).plan(src_idx, dst_idx, dst_entries=dst.entries,
                                             checkpoint=checkpoint)
