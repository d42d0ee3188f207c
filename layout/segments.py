"""Segment tables: which byte ranges ship a set of entries, as numpy arithmetic.

What the transport consumes per request is a C-contiguous int64 `[n, 3]`
table of `(src_offset, dst_offset, nbytes)`, offsets counted from the start
of one registered buffer (`arena_buffers`) on each side. This module derives
it from an arena and two index arrays, and nothing else does: a request
names entries, never bytes.

Everything is vectorised over the index arrays: one ordering by source
(skipped when already sorted; an O(n) scatter for distinct sources in a dense
index space, a stable argsort otherwise), one pass of run detection
(`_merge`: a row joins the previous one when it is adjacent on BOTH sides,
found with one comparison over the whole table and summed with
`np.add.reduceat`). Python loops run over the handful of checkpoint ranges
or fields only, never over entries or layers × entries.

Validation (`check_indices`) happens before any planning, so a bad request
is refused with the offending position and value, and no table — hence no
write — is ever produced from it.

Small requests are the common case (a request names tens of pages, one state
entry), and there numpy's constant cost per call, not the work, is the bill:
so the number of numpy calls is what is kept small. Up to `_TINY` pairs (up
to `_SMALL` when each entry ships one range) plan in plain int arithmetic
(`small_plan._plan_tiny`), which only ever accepts: anything it
doubts goes down the vectorised path, which words the refusal — one place
states each rule's message. Up to `_SMALL` indices, sorting (a few calls on a
few elements) replaces the bitmaps that pay off only for big requests. A
single whole-slot range can only join rows whose entries are consecutive on
both sides, so that case (`_plan_slots`) finds runs on the indices and fills
the table in place, without building and merging per-row byte columns.
"""

from __future__ import annotations

import numpy as np
import torch

from .aliasing import Footprint
from .errors import LayoutError
from .fields import _require_int
from .protocol import Arena
from .runs import _merge, check_layers
from .small_plan import _plan_tiny

# Up to this many indices, a sort of a few elements beats a bitmap over the
# whole index space (which costs the space, not the request), and whole
# entries plan in plain ints.
_SMALL = 64


def _unknown(arena: object) -> LayoutError:
    return LayoutError(
        f"{type(arena).__name__} is not an arena layout knows; it plans any arena kind "
        "answering layout.protocol.Arena (EntryMajorArena, SplitEntryMajorArena, "
        "LayerMajorArena, LayerInterleavedArena, PerLayerArena, ShardMajorArena, "
        "PageMajorMHAArena, PageMajorMambaArena)"
    )


# Classes already seen to answer the protocol. `isinstance` against a runtime-
# checkable Protocol looks up every member each time (several microseconds,
# more than planning a one-entry request costs), so each class pays it once.
_ARENA_TYPES: set[type] = set()


def _known(arena: object) -> Arena:
    """`arena` if it answers the arena protocol, else the refusal naming the kinds."""
    if type(arena) not in _ARENA_TYPES:
        if not isinstance(arena, Arena):
            raise _unknown(arena)
        _ARENA_TYPES.add(type(arena))
    return arena  # type: ignore[return-value]


def arena_buffers(arena: Arena) -> list[torch.Tensor]:
    """The uint8 buffers an arena's bytes live in: what a transport registers, once.

    One per segment table `plan_segments` returns, in the same order.
    """
    return _known(arena).buffers()


def arena_footprints(arena: Arena) -> list[Footprint]:
    """The bytes a peer may write in each of `arena_buffers(arena)` (same order, unlabelled
    where the arena has one buffer): live entries only, so interleaved planes stay apart."""
    return _known(arena).footprints()


def _index_space(arena: Arena) -> tuple[int, int]:
    """`(entries, first_live)`: indices `first_live..entries-1` may be named."""
    return _known(arena).index_space()


def _plural(what: str) -> str:
    """"source index" -> "source indices": how the refusals below name a whole list."""
    return what[:-len("index")] + "indices" if what.endswith("index") else what + "s"


def _as_indices(idx: object, what: str) -> np.ndarray:
    """`idx` as a 1-D integer array (not yet range-checked), or `LayoutError`."""
    if type(idx) is np.ndarray:  # the common case, without the checks below it passes
        if idx.ndim == 1 and idx.dtype.kind in "iu":
            return idx
    elif isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    try:
        arr = np.asarray(idx)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{_plural(what)} must be a 1-D integer array, got {type(idx).__name__}") from exc
    if arr.ndim != 1:
        raise LayoutError(f"{_plural(what)} must be a 1-D array, got shape {list(arr.shape)}")
    if arr.size == 0:
        # `np.asarray([])` is float64; an empty request is still a request.
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise LayoutError(
            f"{_plural(what)} must be integers, got dtype {arr.dtype}; pass entry indices, "
            "e.g. np.asarray(idx, dtype=np.int64)"
        )
    return arr


def _check_range(arr: np.ndarray, first_live: int, entries: int, what: str) -> None:
    if arr.size == 0:
        return
    lo, hi = arr.min(), arr.max()
    if lo < 0:
        pos = int(np.flatnonzero(arr < 0)[0])
        raise LayoutError(
            f"{what} {int(arr[pos])} at position {pos} is negative; entry indices count from 0"
        )
    if hi >= entries:
        pos = int(np.flatnonzero(arr >= entries)[0])
        raise LayoutError(
            f"{what} {int(arr[pos])} at position {pos} is >= the {entries} entries; "
            f"valid indices are 0..{entries - 1}"
        )
    if lo < first_live:
        pos = int(np.flatnonzero(arr < first_live)[0])
        raise LayoutError(
            f"{what} {int(arr[pos])} at position {pos} is outside the live entries "
            f"{first_live}..{entries - 1} ({entries - first_live} of {entries} live); "
            f"entries below {first_live} belong to whoever shares the buffer"
        )


def _dense(arr: np.ndarray, space: int) -> bool:
    # A bitmap over the index space beats a sort while the space is within a
    # small multiple of the indices named; past that, sorting is cheaper.
    return space <= 8 * arr.size + 4096


def _check_unique(arr: np.ndarray, what: str, space: int) -> None:
    if arr.size < 2:
        return
    if arr.size <= _SMALL:
        ordered = np.sort(arr)
        if not (ordered[1:] == ordered[:-1]).any():
            return
    else:
        # Strictly increasing (the common case) proves uniqueness without a sort.
        if (arr[1:] > arr[:-1]).all():
            return
        if _dense(arr, space):
            seen = np.zeros(space, dtype=bool)
            seen[arr] = True
            if int(np.count_nonzero(seen)) == arr.size:
                return
        ordered = np.sort(arr)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if same.size:
        value = int(ordered[same[0]])
        count = int(np.count_nonzero(arr == value))
        raise LayoutError(
            f"{what} {value} appears {count} times; each destination entry may be written "
            "once per transfer"
        )


def _source_order(src: np.ndarray, space: int) -> np.ndarray | None:
    """Permutation sorting `src` ascending, or None when it already is.

    Distinct sources in a dense index space sort by scattering positions into
    a table indexed by entry (O(n), a few times faster than a comparison
    sort); repeated sources fall back to a stable argsort. (Small requests
    are ordered by `_small_pairs`.)
    """
    if src.size < 2 or (src[1:] >= src[:-1]).all():
        return None
    if _dense(src, space):
        pos = np.full(space, -1, dtype=np.int64)
        pos[src] = np.arange(src.size, dtype=np.int64)
        order = pos[pos >= 0]
        if order.size == src.size:
            return order
    return np.argsort(src, kind="stable")


def _small_pairs(
    src: np.ndarray, dst: np.ndarray, live: tuple[int, int], dst_entries: int
) -> np.ndarray | None:
    """`[2, n]` int64 (sources, destinations), checked and ordered by source; None if in doubt.

    For requests of up to `_SMALL` pairs, in about ten numpy calls: both
    index arrays go into one array, so one max checks both ranges (viewed
    unsigned, a negative index is huge) and one gather reorders both. Like
    `_plan_tiny` it never words a refusal: a doubtful request (a bad index, a
    repeated destination, an unsigned index that wrapped in the int64 copy)
    goes to `_check_range`/`_check_unique`, which find and name it.
    """
    first_live, entries = live
    pair = np.empty((2, src.size), dtype=np.int64)
    pair[0] = src
    pair[1] = dst
    hi = pair.view(np.uint64).max(axis=1).tolist()
    if hi[0] >= entries or hi[1] >= dst_entries or (first_live and int(pair[0].min()) < first_live):
        return None
    ordered = pair[1].copy()
    ordered.sort()
    if np.count_nonzero(ordered[1:] == ordered[:-1]):
        return None
    return pair.take(pair[0].argsort(kind="stable"), axis=1)


def check_indices(
    arena: Arena, idx: object, *, what: str = "index", unique: bool = False
) -> np.ndarray:
    """A validated int64 copy of `idx`, or `LayoutError` naming the position and value.

    Exists so the receiving side can refuse its destination entries up front,
    before it promises anything to a sender. Refuses non-1-D and non-integer
    arrays, negative indices, indices `>= arena.entries`, indices below the
    arena's live range, and (with `unique=True`) repeated indices.
    """
    arr = _as_indices(idx, what)
    entries, first_live = _index_space(arena)
    if 0 < arr.size <= _SMALL:  # plain ints prove a good request; a bad one is worded below
        vals = arr.tolist()
        if (min(vals) >= first_live and max(vals) < entries
                and (not unique or len(set(vals)) == len(vals))):
            return arr.astype(np.int64, copy=True)
    _check_range(arr, first_live, entries, what)
    out = arr.astype(np.int64, copy=True)
    if unique:
        _check_unique(out, what, entries)
    return out


def coalesce(table: np.ndarray) -> np.ndarray:
    """`table` sorted by source with rows adjacent on both sides merged, empty rows dropped.

    For callers that build or concatenate tables themselves; `plan_segments`
    already returns coalesced tables. Refuses what is not an integer `[n, 3]`
    table or has a negative length.
    """
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise LayoutError(
            f"a segment table has shape [n, 3] (src_offset, dst_offset, nbytes), "
            f"got {list(arr.shape)}"
        )
    if arr.shape[0] and arr.dtype.kind not in "iu":
        raise LayoutError(f"a segment table holds integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    negative = np.flatnonzero(arr[:, 2] < 0)
    if negative.size:
        row = int(negative[0])
        raise LayoutError(f"segment row {row} has negative nbytes {int(arr[row, 2])}")
    arr = arr[arr[:, 2] > 0]
    src = arr[:, 0]
    if src.size > 1 and not bool(np.all(src[1:] >= src[:-1])):
        arr = arr[np.lexsort((arr[:, 1], src))]
    return _merge(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())


def _index_pair(src_idx: object, dst_idx: object) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination indices as arrays of one length (not yet range-checked)."""
    src = _as_indices(src_idx, "source index")
    dst = _as_indices(dst_idx, "destination index")
    if src.size != dst.size:
        raise LayoutError(
            f"{src.size} source indices but {dst.size} destination indices; pass one "
            "destination entry per source entry"
        )
    return src, dst


def plan_segments(
    arena: Arena,
    src_idx: object,
    dst_idx: object,
    *,
    checkpoint: bool = False,
    dst_entries: int | None = None,
    layers: tuple[int, int] | None = None,
) -> list[np.ndarray]:
    """Segment tables shipping entries `src_idx[k]` of `arena` to `dst_idx[k]` of its peer.

    One table per buffer, in `arena_buffers` order; each covers exactly the
    bytes of the named entries (only their `in_checkpoint` ranges with
    `checkpoint=True`), merged where consecutive on both sides. The peer is
    assumed to have the same format (equal `fingerprint`); `dst_entries` is
    its entry count (default: ours), which places layer-major regions.
    `layers=(a, b)` ships only layers `a..b-1` of every field (those of a
    field with fewer layers that it has); the arena says which bytes those
    are (`LayerInterleavedArena`: one prefix-free range per entry).

    Refusals, all before any planning: non-1-D or non-integer indices,
    unequal lengths, negative indices, sources outside this arena's live
    range, destinations `>= dst_entries`, repeated destinations, a layer
    range outside the fields' layers.
    """
    src, dst = _index_pair(src_idx, dst_idx)
    entries, first_live = _index_space(arena)
    dst_entries = entries if dst_entries is None else _require_int(dst_entries, "dst_entries")
    if layers is not None:
        layers = check_layers(layers, arena.fields)
    if src.size <= _SMALL:
        planes = arena.strided(checkpoint, layers)
        tables = None if planes is None else _plan_tiny(planes, src, dst, (first_live, entries),
                                                        dst_entries)
        if tables is not None:
            return tables
    small = 0 < src.size <= _SMALL
    pair = _small_pairs(src, dst, (first_live, entries), dst_entries) if small else None
    if pair is None:
        _check_range(src, first_live, entries, "source index")
        _check_range(dst, 0, dst_entries, "destination index")
        pair = np.empty((2, src.size), dtype=np.int64)
        pair[0] = src
        pair[1] = dst
        _check_unique(pair[1], "destination index", dst_entries)
        order = _source_order(pair[0], entries)
        if order is not None:
            pair = pair.take(order, axis=1)

    return arena.plan(pair, dst_entries, checkpoint, layers)
