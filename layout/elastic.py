"""A page pool and a state pool in one allocation, split at a boundary that moves.

Hybrid models (Mamba/GDN + attention, DeepSeek-V4's compressors) keep two
kinds of cache: paged KV, one entry per page, and per-request state, one
entry per request. Which split between them is right depends on the
traffic, and a fixed split wastes memory either way. So `ElasticPools`
carves both out of ONE allocation of `slots` equal slots: slots
`0 .. boundary-1` are pages, slots `boundary .. slots-1` are states, and
the boundary can move.

The index spaces are the slot indices themselves, which is what makes a
move cheap to describe: page `i` and state `i` both live in slot `i`. The
page pool is an `EntryMajorArena` of `boundary` entries; the state pool is
one of `slots` entries whose `live_entries` (`slots - boundary`) counts
from the END, so a growing state pool takes the next index down (the
entry-arena design's rule). Both arenas stride by the slot, so a page (or
a state) smaller than the slot leaves a gap nobody owns, and nothing here
writes it.

Split planes: a row space whose planes differ in width (`plane_bytes`, one
slot's bytes in each plane) holds each pool's fields spread over the planes
by `plan_field_planes`, so both pools become `SplitEntryMajorArena`s over
the same planes, which are carved from the one allocation.

Moving the boundary is two steps, both here:
- `plan_resize(pools, boundary, used)` says which entries of the pool that
  shrinks must leave the vacated slots (`used`: the ones holding data the
  caller keeps) and where they go: the free slots of that pool farthest
  from the boundary, so they are the last to be vacated again. Sources and
  destinations are both sorted, so pairing them in order makes one run per
  stretch that is contiguous on both sides; everything is array arithmetic
  over a mask of the slots, no per-entry Python.
- `relocate(pools, plan)` copies each run with one `copy_` per plane (a
  strided `[count, entry_bytes]` view when the entry is narrower than the
  slot, so no gap byte is written), then moves the boundary and rebuilds
  the two arenas. It returns the `IndexMap` (old -> new indices of the moved
  entries) the caller's allocator and request tables apply.

This is the copy discipline the entry-arena design gives checkpoints (one
`copy_` per contiguous range, on the tensors' own device, CUDA or CPU),
applied to whole entries. Sources are in the vacated range and
destinations outside it, so no copy reads bytes another one writes. A CUDA relocation synchronizes its stream
before returning: a peer may write into the vacated slots as soon as the
new boundary is announced, and the copies must have read them by then.

Deliberately absent: one batched gather/scatter for many short runs. A run
costs a few µs of Python and dispatch over its bytes (docs/benchmarks.md,
"Elastic pools"), which matters only for moves of hundreds of scattered
entries, and an allocator that keeps entries away from the boundary rarely
makes those; add it (as `transport/device_copy.py` batches) if one does.
Also absent: moving an entry that is being transferred. Layout cannot know
that; the PD engine refuses such a resize (`pdxfer`'s `Engine.resize`).
And filling newly live entries with their fields' declared fills. They hold whatever the other pool left, like any
entry a free list hands out, and a caller resets an entry when it takes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arenas import EntryMajorArena, SplitEntryMajorArena, plan_field_planes
from .checks import _check_names
from .errors import LayoutError
from .fields import (
    _ALIGN,
    EntryField,
    _align_up,
    _require_int,
    carve,
    entry_bytes_for,
    plan_regions,
    strictest_align,
)

PAGE, STATE = "page", "state"


@dataclass(frozen=True)
class IndexMap:
    """Where moved entries went: `old[k]` is now `new[k]` (sorted by `old`)."""

    old: np.ndarray
    new: np.ndarray

    def __len__(self) -> int:
        return int(self.old.size)

    def remap(self, idx: Any) -> np.ndarray:
        """`idx` with every moved index replaced by its new one (others unchanged), vectorised."""
        arr = np.asarray(idx, dtype=np.int64)
        out = arr.copy()
        if not self.old.size or not arr.size:
            return out
        pos = np.searchsorted(self.old, arr)
        hit = pos < self.old.size
        hit[hit] = self.old[pos[hit]] == arr[hit]
        out[hit] = self.new[pos[hit]]
        return out


@dataclass(frozen=True)
class ResizePlan:
    """What moving a boundary takes: which entries move where, as runs.

    `shrinking` is the pool that gives up `vacated` (a `[lo, hi)` slot
    range): "page" when the boundary moves down (the state pool grows),
    "state" when it moves up, None when it stays. `runs` is int64 `[n, 3]`
    `(src_slot, dst_slot, count)`, contiguous on both sides; `moves` maps
    each moved entry's old index to its new one. `entry_bytes` is what one
    moved entry copies, summed over the planes.
    """

    slots: int
    old_boundary: int
    boundary: int
    shrinking: str | None
    vacated: tuple[int, int]
    moves: IndexMap
    runs: np.ndarray
    entry_bytes: int

    @property
    def entries(self) -> int:
        """How many entries move."""
        return len(self.moves)

    @property
    def nbytes(self) -> int:
        """Bytes the relocation copies."""
        return self.entries * self.entry_bytes

    def remap(self, idx: Any) -> np.ndarray:
        """`self.moves.remap(idx)`: a caller's indices after the move."""
        return self.moves.remap(idx)


@dataclass(frozen=True)
class _Geometry:
    """Where each pool's fields sit: per plane, the slot width and each pool's field group."""

    widths: list[int]
    page: list[list[EntryField]]
    state: list[list[EntryField]]
    aligns: list[int]
    split: bool = False

    def region_sizes(self, slots: int) -> list[int]:
        return [slots * w for w in self.widths]


def _place(fields: list[EntryField], widths: list[int], what: str) -> list[list[EntryField]]:
    groups, rows = plan_field_planes(fields, widths)
    if rows > 1:
        need = entry_bytes_for(fields)
        raise LayoutError(
            f"the {what} pool's fields ({need} B an entry) do not fit one slot of planes "
            f"{widths} B: the best split takes {rows} rows; widen the planes (they must hold "
            "one entry of each pool per slot)"
        )
    return groups


def _geometry(page_fields: Sequence[EntryField], state_fields: Sequence[EntryField],
              plane_bytes: Sequence[int] | None) -> _Geometry:
    """The slot widths and field placement, checked; the one place sizing and building agree."""
    page, state = list(page_fields), list(state_fields)
    _check_names(page)
    _check_names(state)
    if plane_bytes is None:
        align = math.lcm(strictest_align(page), strictest_align(state))
        width = _align_up(max(entry_bytes_for(page), entry_bytes_for(state), _ALIGN), align)
        return _Geometry([width], [page], [state], [align])
    widths = [_require_int(w, f"plane {p} width", minimum=1) for p, w in enumerate(plane_bytes)]
    if not widths:
        raise LayoutError("plane_bytes must name at least one plane width")
    geo_page, geo_state = _place(page, widths, PAGE), _place(state, widths, STATE)
    aligns = []
    for p, width in enumerate(widths):
        align = math.lcm(strictest_align(geo_page[p]), strictest_align(geo_state[p]))
        if width % align:
            raise LayoutError(
                f"plane {p} width {width} B must be a multiple of {align} B (the strictest "
                "field alignment in it), or slots past the first fall off the boundary their "
                f"views retype from; use {_align_up(width, align)}"
            )
        aligns.append(align)
    return _Geometry(widths, geo_page, geo_state, aligns, split=len(widths) > 1)


class ElasticPools:
    """A page pool (`page`) and a state pool (`state`) sharing `slots` slots of one allocation.

    `boundary` slots are pages (indices `0..boundary-1`), the rest states
    (indices `boundary..slots-1`). `buf` (a 1-D uint8 tensor of at least
    `allocation_bytes(...)`) is carved into the planes; None allocates a
    zeroed one on `device`. Fills follow `EntryMajorArena`: with `fill=None`
    an owned allocation gets each pool's declared fills in its live entries
    and a caller's buffer is left as it is.

    `page` and `state` are rebuilt by `relocate` whenever the boundary
    moves, over the same planes: take them again after a move (views from
    before keep their old entry counts).
    """

    def __init__(
        self,
        page_fields: Sequence[EntryField],
        state_fields: Sequence[EntryField],
        slots: int,
        boundary: int,
        device: torch.device | str | None = None,
        *,
        plane_bytes: Sequence[int] | None = None,
        buf: torch.Tensor | None = None,
        fill: bool | None = None,
    ) -> None:
        if fill is not None and not isinstance(fill, bool):
            raise LayoutError(f"fill must be True, False or None (fill iff owned), got {fill!r}")
        self.slots = _require_int(slots, "slots", minimum=1)
        self.boundary = _check_boundary(boundary, self.slots)
        self._geo = _geometry(page_fields, state_fields, plane_bytes)
        sizes = self._geo.region_sizes(self.slots)
        _, total = plan_regions(sizes, self._geo.aligns)
        if buf is None:
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            fill = True if fill is None else fill
        self.buf = buf
        self.planes: list[torch.Tensor] = carve(buf, sizes, self._geo.aligns)  # type: ignore[assignment]
        self.page: EntryMajorArena | SplitEntryMajorArena
        self.state: EntryMajorArena | SplitEntryMajorArena
        self._build(bool(fill))

    @staticmethod
    def allocation_bytes(page_fields: Sequence[EntryField], state_fields: Sequence[EntryField],
                         slots: int, *, plane_bytes: Sequence[int] | None = None) -> int:
        """Bytes of the allocation `ElasticPools(...)` carves: size a caller's `buf` with it."""
        geo = _geometry(page_fields, state_fields, plane_bytes)
        return plan_regions(geo.region_sizes(_require_int(slots, "slots", minimum=1)), geo.aligns)[1]

    @property
    def plane_bytes(self) -> list[int]:
        """One slot's bytes in each plane (the arenas' slot stride)."""
        return list(self._geo.widths)

    def entry_bytes(self, pool: str) -> list[int]:
        """Bytes one entry of `pool` ("page" or "state") takes in each plane."""
        groups = self._groups(pool)
        return [entry_bytes_for(g) for g in groups]

    def _groups(self, pool: str) -> list[list[EntryField]]:
        if pool == PAGE:
            return self._geo.page
        if pool == STATE:
            return self._geo.state
        raise LayoutError(f"pool must be {PAGE!r} or {STATE!r}, got {pool!r}")

    def _arena(self, groups: list[list[EntryField]], entries: int, live: int,
               fill: bool) -> EntryMajorArena | SplitEntryMajorArena:
        arenas = [EntryMajorArena(g, entries, None, buf=plane, slot_stride=w, live_entries=live,
                                  fill=fill)
                  for g, plane, w in zip(groups, self.planes, self._geo.widths, strict=True)]
        return SplitEntryMajorArena(arenas) if self._geo.split else arenas[0]

    def _build(self, fill: bool) -> None:
        b, n = self.boundary, self.slots
        self.page = self._arena(self._geo.page, b, b, fill)
        self.state = self._arena(self._geo.state, n, n - b, fill)

    def __repr__(self) -> str:
        return (f"ElasticPools(slots={self.slots}, boundary={self.boundary}, "
                f"plane_bytes={self._geo.widths})")


def _check_boundary(boundary: object, slots: int) -> int:
    value = _require_int(boundary, "boundary")
    if value > slots:
        raise LayoutError(
            f"boundary {value} is past the {slots} slots; it counts the page slots, "
            f"0..{slots}"
        )
    return value


def _used_mask(used: Any, live: tuple[int, int], slots: int, pool: str) -> np.ndarray:
    """A slot mask of `used`, refusing an index outside the pool's live range (named)."""
    try:
        arr = np.asarray(used)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"used must be a 1-D array of {pool} entry indices") from exc
    if arr.size == 0:
        arr = np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LayoutError(
            f"used must be a 1-D integer array of {pool} entry indices, got shape "
            f"{list(arr.shape)} {arr.dtype}"
        )
    lo, hi = live
    bad = np.flatnonzero((arr < lo) | (arr >= hi))
    if bad.size:
        pos = int(bad[0])
        raise LayoutError(
            f"used {pool} entry {int(arr[pos])} at position {pos} is outside the {pool} "
            f"pool's live entries {lo}..{hi - 1}; pass the entries of the pool that shrinks"
        )
    mask = np.zeros(slots, dtype=bool)
    mask[arr] = True
    return mask


def plan_resize(pools: ElasticPools, boundary: int, used: Any) -> ResizePlan:
    """Which entries must move, and where, to put the boundary at `boundary`.

    `used` are the entries of the pool that shrinks (pages when `boundary`
    is lower, states when it is higher) that hold data the caller keeps;
    the others in the vacated slots are simply dropped. Refuses (naming the
    numbers) a boundary outside `0..slots`, a `used` index outside that
    pool's live range, and a move that leaves the shrinking pool too few
    free entries for the ones it must take in. Nothing is copied here.
    """
    if not isinstance(pools, ElasticPools):
        raise LayoutError(f"plan_resize needs an ElasticPools, got {type(pools).__name__}")
    slots, old = pools.slots, pools.boundary
    new = _check_boundary(boundary, slots)
    if new == old:
        empty = np.empty(0, dtype=np.int64)
        return ResizePlan(slots, old, new, None, (new, new), IndexMap(empty, empty.copy()),
                          np.empty((0, 3), dtype=np.int64), 0)
    if new < old:  # the state pool grows: pages in [new, old) leave for the lowest free pages
        pool, live, vacated, kept, lowest = PAGE, (0, old), (new, old), (0, new), True
    else:  # the page pool grows: states in [old, new) leave for the highest free states
        pool, live, vacated, kept, lowest = STATE, (old, slots), (old, new), (new, slots), False
    mask = _used_mask(used, live, slots, pool)
    src = np.flatnonzero(mask[vacated[0]:vacated[1]]) + vacated[0]
    free = np.flatnonzero(~mask[kept[0]:kept[1]]) + kept[0]
    if free.size < src.size:
        raise LayoutError(
            f"moving the boundary {old} -> {new} vacates {src.size} used {pool} entries, but "
            f"the {pool} pool keeps only {free.size} free of its {kept[1] - kept[0]}; free "
            f"{src.size - free.size} more {pool} entries first, or move the boundary less"
        )
    dst = free[: src.size] if lowest else free[free.size - src.size:]
    return ResizePlan(slots, old, new, pool, vacated, IndexMap(src, dst.copy()), _runs(src, dst),
                      sum(pools.entry_bytes(pool)))


def _runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """`(src, dst, count)` per stretch consecutive on both sides (both sorted ascending)."""
    if not src.size:
        return np.empty((0, 3), dtype=np.int64)
    brk = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:, 2] = np.diff(np.append(starts, src.size))
    return out


def _entries_view(plane: torch.Tensor, first: int, count: int, width: int,
                  nbytes: int) -> torch.Tensor:
    """`count` entries' bytes from slot `first`: a slice when they fill the slot, else strided."""
    start = first * width
    if nbytes == width:
        return plane[start:start + count * width]
    # storage_offset is absolute: add the plane's own (it is carved out of the allocation).
    return plane.as_strided((count, nbytes), (width, 1), plane.storage_offset() + start)


def relocate(pools: ElasticPools, plan: ResizePlan) -> IndexMap:
    """Carry out `plan`: copy every run (one `copy_` per run and plane), then move the boundary.

    Writes only the bytes of the moved entries' new slots; reads only those
    of their old ones. Refuses a plan made for another boundary (a stale
    plan: the pools moved since) before copying anything. Returns the
    moves, for the caller's allocator. CUDA: returns once the copies are done.
    """
    if not isinstance(pools, ElasticPools) or not isinstance(plan, ResizePlan):
        raise LayoutError("relocate(pools, plan) takes an ElasticPools and its plan_resize result")
    if (plan.slots, plan.old_boundary) != (pools.slots, pools.boundary):
        raise LayoutError(
            f"this plan moves the boundary {plan.old_boundary} -> {plan.boundary} of "
            f"{plan.slots} slots, but the pools have boundary {pools.boundary} of "
            f"{pools.slots}; plan again from the current boundary"
        )
    if plan.entries:
        assert plan.shrinking is not None
        runs = plan.runs.tolist()  # a loop per run, never per entry
        for plane, width, nbytes in zip(pools.planes, pools.plane_bytes,
                                        pools.entry_bytes(plan.shrinking), strict=True):
            if not nbytes:
                continue
            for src, dst, count in runs:
                _entries_view(plane, dst, count, width, nbytes).copy_(
                    _entries_view(plane, src, count, width, nbytes))
        if pools.buf.is_cuda:
            torch.cuda.current_stream(pools.buf.device).synchronize()
    pools.boundary = plan.boundary
    pools._build(False)
    return plan.moves
