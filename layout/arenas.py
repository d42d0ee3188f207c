"""A field declaration materialized: where the entry axis sits decides the arena.

`EntryMajorArena` puts the entry axis outermost, so entry `i` starts at
`i * slot_stride` and is one contiguous byte range: one `copy_` per checkpoint
range, one registered range and one write per run of entries over RDMA. It
still hands kernels the per-layer views they take today (`view(name)` →
`[layers, entries, *shape]`), only with a larger slot stride.

`LayerMajorArena` (`layout.layer_major`) reads the same field list with the
layer axis outermost; `LayerInterleavedArena` (`layout.interleaved`) keeps
the entry axis outermost but orders an entry's bytes layer first.

`SplitEntryMajorArena` covers a row space whose planes differ in width: a
field is one strided tensor, so it lands in one plane (`plan_field_planes`
picks which) and the split arena lets consumers ask for it by name.

All arithmetic is `layout.fields`' one walk; this module only decides strides
and who may write which bytes. Each class answers the arena protocol
(`layout.protocol`) itself, so no planner asks which class it holds.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .aliasing import Footprint
from .checks import _check_names, too_small
from .errors import LayoutError
from .fields import (
    _ALIGN,
    EntryField,
    _require_int,
    check_buffer,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    field_view,
    strictest_align,
)
from .protocol import base_description
from .runs import _plan_strided, check_layers, join_ranges


class EntryMajorArena:
    """`entries` fixed-size entries, one `slot_stride` apart, each contiguous.

    The stride is `entry_bytes` when the arena owns its buffer, and whatever
    the caller says when it lives at the front of a slot in a shared plane.
    Then `live_entries` (counted from the END of the index range, since a pool
    that grows takes the next index down) says which entries are really the
    caller's; nothing outside them is ever written, fills included.

    Fill behaviour (`fill`): an arena that allocates its buffer zeroes it and
    writes every field's declared `fill` into the live entries. An arena over
    a caller's `buf` (an engine's KV tensor, an IPC-imported pool) never
    decides alone whether to write: wrapping memory must not change it, yet a
    declared `-inf` score left at 0.0 turns "never selected" into "always".
    So over a caller's buffer whose fields declare a non-zero fill, `fill`
    must be said: `fill=True` writes the declared fills into the live
    entries (a freshly carved plane), `fill=False` leaves the bytes as they
    are (memory that already holds cache); left at None it is refused, as
    `LayerMajorArena` refuses. Without declared fills a caller's buffer is
    never written. `fill=False` also skips the fills of an owned buffer.
    Padding bytes of a caller's buffer are whatever the caller left there,
    and they travel with the entry.
    """

    kind = "entry_major"

    def __init__(
        self,
        fields: list[EntryField],
        entries: int,
        device: torch.device | str | None,
        buf: torch.Tensor | None = None,
        slot_stride: int | None = None,
        live_entries: int | None = None,
        *,
        fill: bool | None = None,
    ) -> None:
        # No fields is legal here (unlike `LayerMajorArena`): a plane is
        # addressed by index and still costs its rows even when
        # `plan_field_planes` leaves it empty.
        if fill is not None and not isinstance(fill, bool):
            raise LayoutError(f"fill must be True, False or None (fill iff owned), got {fill!r}")
        unsaid = [f.name for f in fields if f.fill] if buf is not None and fill is None else []
        if unsaid:
            raise LayoutError(
                f"fields {unsaid} declare a non-zero fill and buf is the caller's: pass "
                "fill=True to write it into the live entries (a fresh buffer), or fill=False "
                "to leave the buffer as it is (it already holds cache)"
            )
        self._setup(fields, entries, device, buf, slot_stride, live_entries,
                    base_align=_ALIGN, fill=buf is None if fill is None else fill)

    def _setup(
        self,
        fields: Sequence[EntryField],
        entries: int,
        device: torch.device | str | None,
        buf: torch.Tensor | None,
        slot_stride: int | None,
        live_entries: int | None,
        *,
        base_align: int,
        fill: bool,
    ) -> None:
        """Shared by the page-major pools, which are this arena over a packed walk."""
        _check_names(fields)
        self.fields = list(fields)
        self.entries = _require_int(entries, "entries")
        self.base_align = base_align
        self.entry_bytes, self._align, self._offsets, self.checkpoint_ranges = (
            self._walk(base_align))
        if slot_stride is None:
            slot_stride = self.entry_bytes
        self.slot_stride = _require_int(slot_stride, "slot_stride")
        if self.slot_stride < self.entry_bytes:
            raise LayoutError(
                f"slot stride {self.slot_stride} is under the {self.entry_bytes} B an "
                f"entry takes; pass slot_stride >= {self.entry_bytes}"
            )
        if self.slot_stride % self._align:
            raise LayoutError(
                f"slot stride {self.slot_stride} must be a multiple of {self._align}, or "
                "entries past the first fall off the boundary their field views retype from"
            )
        live = self.entries if live_entries is None else live_entries
        self.live_entries = _require_int(live, "live_entries")
        if self.live_entries > self.entries:
            raise LayoutError(
                f"live_entries {self.live_entries} outside 0..{self.entries}; it counts the "
                "entries at the top of the index range this arena may write"
            )
        self._by_name = {f.name: f for f in self.fields}
        want = self.total_bytes
        if buf is None:
            # Zeroed, not `empty`: padding lies outside every field view and
            # an entry travels whole, so uninitialized padding would travel.
            self.buf = torch.zeros(want, dtype=torch.uint8, device=device)
        else:
            if isinstance(buf, torch.Tensor) and buf.dim() == 1 and buf.numel() < want:
                raise LayoutError(too_small(self.fields, self.entries, self.entry_bytes,
                                            self.slot_stride, buf.numel(), base_align))
            check_buffer(buf, want, self._align)
            self.buf = buf
        # Building every view validates every field against the buffer
        # before anything is written.
        views = {f.name: self.view(f.name) for f in self.fields}
        if fill:
            for f in self.fields:
                views[f.name][:, self.first_live :].fill_(f.fill)

    def _walk(self, base_align: int) -> tuple[int, int, dict[str, int], list[tuple[int, int]]]:
        """`(entry_bytes, strictest alignment, field offsets, checkpoint ranges)` of one entry.

        Every one of them is an answer to `layout.fields`' one walk over the
        fields; a subclass that orders an entry's bytes otherwise overrides
        this (and `_layer_stride`), and inherits everything else.
        """
        extents = list(field_extents(self.fields, base_align=base_align))
        return (entry_bytes_for(self.fields, base_align=base_align),
                strictest_align(self.fields, base_align=base_align),
                {f.name: start for f, start, _ in extents},
                checkpoint_ranges_for(self.fields, base_align=base_align))

    def _layer_stride(self, field: EntryField) -> int:
        """Bytes from one layer of `field` to the next inside an entry."""
        return field.per_layer_bytes

    @property
    def first_live(self) -> int:
        """The lowest entry index this arena may write."""
        return self.entries - self.live_entries

    @property
    def total_bytes(self) -> int:
        """Bytes the entries span, from the first to the end of the last (0 for none).

        `entries * entry_bytes` only when the stride is the entry's own size;
        with a wider stride the gaps belong to whoever shares the buffer, and
        this counts them.
        """
        if not self.entries:
            return 0
        return (self.entries - 1) * self.slot_stride + self.entry_bytes

    def _field(self, name: str) -> EntryField:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutError(
                f"no field {name!r} in this arena; it has {list(self._by_name)}"
            ) from None

    def view(self, name: str) -> torch.Tensor:
        """`[layers, entries, *shape]`: a drop-in for the standalone tensor.

        Only the slot stride differs from a standalone allocation. Kernels
        that take the slot stride as an argument are unaffected; one that
        assumes contiguity is not, and has to be checked.
        """
        field = self._field(name)
        return field_view(
            self.buf,
            field,
            self.entries,
            offset=self._offsets[name],
            layer_stride=self._layer_stride(field),
            entry_stride=self.slot_stride,
        )

    def entry(self, index: int) -> torch.Tensor:
        """One entry's whole state as a contiguous 1-D uint8 slice."""
        try:
            i = operator.index(index)
        except TypeError:
            i = None
        if i is None or isinstance(index, bool) or not 0 <= i < self.entries:
            raise LayoutError(f"entry index {index!r} outside 0..{self.entries - 1}")
        start = i * self.slot_stride
        return self.buf[start : start + self.entry_bytes]

    def field_offset(self, name: str) -> int:
        """Byte offset of a field from the start of an entry."""
        self._field(name)
        return self._offsets[name]

    def entry_ranges(self, checkpoint: bool = False,
                     layers: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """`(offset, nbytes)` of one entry that ship, from the entry's start.

        The whole entry, or its checkpoint ranges (`checkpoint=True`); with
        `layers=(a, b)` only layers `a..b-1` of every field, which here is one
        range per field (a field's layers are contiguous inside an entry).
        Refuses `(a, b)` outside `0 <= a < b <=` the deepest field's layers.
        """
        return self._spans(checkpoint, None if layers is None else check_layers(layers, self.fields))

    def _spans(self, checkpoint: bool, layers: tuple[int, int] | None) -> list[tuple[int, int]]:
        """`entry_ranges` for a layer range already checked (against a whole split
        arena's fields, which may be deeper than this plane's: those layers it lacks)."""
        if layers is None:
            return self.checkpoint_ranges if checkpoint else [(0, self.entry_bytes)]
        a, b = layers
        ranges = []
        for f in self.fields:
            top = min(b, f.layers)
            if top > a and not (checkpoint and not f.in_checkpoint):
                step = self._layer_stride(f)
                ranges.append((self._offsets[f.name] + a * step, (top - a) * step))
        return join_ranges(ranges)

    # -- the arena protocol (`layout.protocol`) --

    def buffers(self) -> list[torch.Tensor]:
        """The one buffer every entry lives in."""
        return [self.buf]

    def footprints(self) -> list[Footprint]:
        """The live entries' slots: the gaps and the entries below belong to others."""
        return [_live_slots(self, "")]

    def index_space(self) -> tuple[int, int]:
        """`(entries, first_live)`."""
        return self.entries, self.first_live

    def strided(self, checkpoint: bool,
                layers: tuple[int, int] | None) -> list[tuple[int, list[tuple[int, int]]]]:
        """`[(slot_stride, entry_ranges)]`: every entry ships the same ranges of its slot."""
        return [(self.slot_stride, self.entry_ranges(checkpoint, layers))]

    def plan(self, pair: np.ndarray, dst_entries: int, checkpoint: bool,
             layers: tuple[int, int] | None) -> list[np.ndarray]:
        """Each entry's ranges at `index * slot_stride`, merged across consecutive entries."""
        return [_plan_strided(pair, stride, ranges) for stride, ranges in self.strided(checkpoint, layers)]

    def description(self) -> dict[str, Any]:
        """The common keys, with this arena's slot stride."""
        return base_description(self, self.slot_stride)


def _live_slots(arena: EntryMajorArena, label: str) -> Footprint:
    return Footprint.of(label, str(arena.buf.device),
                        int(arena.buf.data_ptr()) + arena.first_live * arena.slot_stride,
                        arena.slot_stride, arena.entry_bytes, arena.live_entries)


class SplitEntryMajorArena:
    """One request's state spread over the planes of a row space.

    Every plane is an `EntryMajorArena` over the same slots (same `entries`
    and `live_entries`, since a row index means one thing across planes). A
    consumer asks for a field by name and never learns the plane. There is
    deliberately no whole-entry accessor: what is contiguous is each plane's
    part of a slot, which is what `plan_segments` ships, one table per plane.
    """

    kind = "split_entry_major"

    def __init__(self, arenas: list[EntryMajorArena]) -> None:
        if not arenas:
            raise LayoutError("a split arena needs at least one plane")
        for arena in arenas:
            if type(arena) is not EntryMajorArena:
                raise LayoutError(
                    f"every plane must be an EntryMajorArena, got {type(arena).__name__}"
                )
        self.arenas = list(arenas)
        first = self.arenas[0]
        for p, arena in enumerate(self.arenas):
            if (arena.entries, arena.live_entries) != (first.entries, first.live_entries):
                raise LayoutError(
                    f"plane {p} has {arena.entries} entries ({arena.live_entries} live) but "
                    f"plane 0 has {first.entries} ({first.live_entries} live); the planes "
                    "of one row space share their slots"
                )
        self._by_field: dict[str, EntryMajorArena] = {}
        for arena in self.arenas:
            for field in arena.fields:
                if field.name in self._by_field:
                    raise LayoutError(f"field {field.name!r} is in two planes")
                self._by_field[field.name] = arena
        self.entries = first.entries
        self.live_entries = first.live_entries

    @property
    def fields(self) -> list[EntryField]:
        """All fields, plane by plane, each plane in its declared order."""
        return [f for arena in self.arenas for f in arena.fields]

    @property
    def entry_bytes(self) -> int:
        """Bytes one request's state takes, summed over the planes."""
        return sum(a.entry_bytes for a in self.arenas)

    def _arena(self, name: str) -> EntryMajorArena:
        try:
            return self._by_field[name]
        except KeyError:
            raise LayoutError(
                f"no field {name!r} in this split arena; it has {list(self._by_field)}"
            ) from None

    def view(self, name: str) -> torch.Tensor:
        """`[layers, entries, *shape]` of field `name`, from whichever plane holds it."""
        return self._arena(name).view(name)

    def field_offset(self, name: str) -> int:
        """Bytes into the plane's slot where field `name` begins."""
        return self._arena(name).field_offset(name)

    def plane_of(self, name: str) -> int:
        """Index of the plane holding field `name`."""
        return self.arenas.index(self._arena(name))

    # -- the arena protocol (`layout.protocol`): one buffer and one table per plane --

    def buffers(self) -> list[torch.Tensor]:
        """Each plane's buffer, in plane order."""
        return [plane.buf for plane in self.arenas]

    def footprints(self) -> list[Footprint]:
        """Each plane's live slots, labelled by plane, so interleaved planes stay apart."""
        return [_live_slots(plane, f"plane {p}") for p, plane in enumerate(self.arenas)]

    def index_space(self) -> tuple[int, int]:
        """`(entries, first_live)`, shared by every plane."""
        return self.entries, self.entries - self.live_entries

    def strided(self, checkpoint: bool,
                layers: tuple[int, int] | None) -> list[tuple[int, list[tuple[int, int]]]]:
        """Every plane's slot stride and ranges, in plane order; `layers` is checked
        against every plane's fields together, so a shallower plane ships what it has."""
        if layers is not None:
            layers = check_layers(layers, self.fields)
        return [(plane.slot_stride, plane._spans(checkpoint, layers)) for plane in self.arenas]

    def plan(self, pair: np.ndarray, dst_entries: int, checkpoint: bool,
             layers: tuple[int, int] | None) -> list[np.ndarray]:
        """One table per plane."""
        return [_plan_strided(pair, stride, ranges) for stride, ranges in self.strided(checkpoint, layers)]

    def description(self) -> dict[str, Any]:
        """The common keys without a stride, and the planes with theirs."""
        desc = base_description(self, None)  # one stride per plane, in `planes`
        desc["planes"] = [
            {"fields": [f.name for f in plane.fields], "entry_bytes": plane.entry_bytes,
             "slot_stride": plane.slot_stride}
            for plane in self.arenas
        ]
        return desc


def plan_field_planes(
    fields: list[EntryField], plane_row_bytes: list[int]
) -> tuple[list[list[EntryField]], int]:
    """Split fields across the planes of one row space, in the fewest rows.

    Every plane materializes the same rows at its own width, so a slot of `r`
    rows offers `r * plane_row_bytes[p]` bytes in plane `p`. Returns
    `(per_plane_fields, rows)`. Exhaustive rather than greedy: `2^6` = 64
    assignments for DeepSeek-V4, once at start-up, so the exact answer is
    cheap. Ties go to the first assignment found (stable across runs); field
    order inside a plane stays the declared order.
    """
    if not plane_row_bytes:
        raise LayoutError("a row space needs at least one plane")
    for p, width in enumerate(plane_row_bytes):
        try:
            _require_int(width, "width", minimum=1)
        except LayoutError:
            raise LayoutError(
                f"plane {p} row width {width!r} B must be a positive integer; a plane of "
                "width 0 holds nothing and cannot take a field"
            ) from None
    _check_names(fields)
    num_planes = len(plane_row_bytes)
    assignments = num_planes ** len(fields)
    if assignments > 1 << 16:
        raise LayoutError(
            f"refusing to enumerate {assignments} assignments of {len(fields)} fields over "
            f"{num_planes} planes (limit {1 << 16}); group fields before planning"
        )
    best: tuple[list[list[EntryField]], int] | None = None
    for code in range(assignments):
        groups: list[list[EntryField]] = [[] for _ in plane_row_bytes]
        rest = code
        for field in fields:
            groups[rest % num_planes].append(field)
            rest //= num_planes
        rows = max(
            -(-entry_bytes_for(group) // width) for group, width in zip(groups, plane_row_bytes, strict=True)
        )
        if best is None or rows < best[1]:
            best = (groups, rows)
    assert best is not None  # assignments >= 1: num_planes ** 0 == 1
    return best
