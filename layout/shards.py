"""Shard-major entries: one rank's KV heads, across every layer and field, as one byte range.

Tensor parallelism splits a cache field along its KV-head axis
(`EntryField.tp_axis`); a field without one (MLA's latent KV, recurrent state)
is replicated on every rank. When a prefill runs TP=P and a decode TP=D, the
part of a decode entry that one prefill rank produces is the overlap of two
head ranges, and in an ordinary entry (field-major: all of k, then all of v,
each layer inside) that overlap is scattered over fields x layers. SGLang's
Mooncake path ships it as one descriptor per token x head group x layer.

So the entry is laid out by *head group* first. A head group ("unit") is the
finest split any TP size can ask for: `units = gcd` of every split field's head
count, and a unit holds `heads // units` heads of each split field, for every
layer, walked by `field_extents` like any entry. A rank at (tp, rank) holds
units `[rank * units/tp, (rank + 1) * units/tp)` back to back, one
`unit_bytes` apart, then its replicated fields. Any contiguous range of heads
is then one contiguous byte range on both sides of any (P, D) pair, so a rank
pair ships one segment per entry (`layout.tp_plan`), with no staging.

The arena is an `EntryMajorArena` over a synthesized field list (`k@3` is head
group 3 of `k`), so entries, strides, live ranges, buffers, checkpoint ranges
and homogeneous planning are the parent's, unchanged. What kernels see:
`view("k")` is `[layers, entries, *shape]` with the local head count on the TP
axis, a STRIDED view whose head stride is `unit_bytes` (one head per unit, the
usual case; torch ops and stride-taking kernels use it as is). A kernel that
needs dense NHD takes `group_view(name, g)` per head group, or permutes
device-locally (`view(name).contiguous()`, writes copied back); when a unit
holds several heads of a field and the rank several units, no single strided
view exists and `view` says so.

`shard_geometry` is the one place the placement is computed; the arena, the
description check and the rank-pair planner all ask it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .arenas import EntryMajorArena, _check_names
from .errors import LayoutError
from .fields import (
    _ALIGN,
    EntryField,
    _require_int,
    entry_bytes_for,
    field_extents,
    strictest_align,
)
from .protocol import FORMAT_VERSION, describe_field


@dataclass(frozen=True)
class ShardGeometry:
    """Where one rank's entry puts its bytes; derived from (fields, tp, rank) only."""

    fields: tuple[EntryField, ...]  # the global (unsharded) declaration
    tp: int
    rank: int
    units: int  # head groups in the global entry; 0 when no field is split
    unit_bytes: int  # bytes of one head group, every layer and split field, aligned
    first_unit: int  # this rank's first head group
    local_units: int
    local: tuple[EntryField, ...]  # the synthesized walk: units, then replicated fields
    unit_extents: tuple[tuple[int, int, bool], ...]  # (offset in unit, bytes, in_checkpoint)
    rep_extents: tuple[tuple[int, int, bool], ...]  # (offset in entry, bytes, in_checkpoint)
    rep_base: int  # where the replicated fields start in this rank's entry
    rep_span: int  # bytes from `rep_base` to the end of the entry
    entry_bytes: int

    @property
    def end_unit(self) -> int:
        return self.first_unit + self.local_units


def split_heads(field: EntryField) -> int:
    """Heads of a split field along its TP axis (0 for a replicated one)."""
    return 0 if field.tp_axis is None else field.shape[field.tp_axis]


def shard_geometry(fields: Sequence[EntryField], tp: int, rank: int) -> ShardGeometry:
    """The placement of rank `rank`'s part of an entry under TP size `tp`.

    Refuses a TP size that does not divide every split field's head count,
    naming the field: a rank holding a fraction of a head cannot exist.
    """
    _check_names(fields)
    tp = _require_int(tp, "TP size", minimum=1)
    rank = _require_int(rank, "TP rank")
    if rank >= tp:
        raise LayoutError(f"TP rank {rank} outside 0..{tp - 1} for TP size {tp}")
    split = [f for f in fields if f.tp_axis is not None]
    rep = [f for f in fields if f.tp_axis is None]
    for f in split:
        heads = split_heads(f)
        if heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise LayoutError(
                f"field {f.name!r} has {heads} heads on tp_axis {f.tp_axis}, which TP size "
                f"{tp} does not divide; use a TP size in {fits} or declare the field "
                "replicated (tp_axis=None)"
            )
    units = math.gcd(*(split_heads(f) for f in split)) if split else 0
    unit_fields = [
        replace(f, shape=f.shape[: f.tp_axis] + (split_heads(f) // units,) + f.shape[f.tp_axis + 1 :])
        for f in split
    ]
    unit_align = strictest_align(unit_fields)
    local_units = units // tp
    first = rank * local_units
    local: list[EntryField] = []
    for u in range(first, first + local_units):
        # The first field of every unit carries the unit's strictest alignment,
        # so the walk starts unit u at exactly u * unit_bytes: the trailing pad
        # of the unit before it is what `entry_bytes_for` rounded it up by.
        for j, f in enumerate(unit_fields):
            local.append(replace(f, name=f"{f.name}@{u}", align=unit_align if j == 0 else f.align))
    if rep:
        # Never inside the last unit's trailing pad, which a unit range covers.
        base_align = max(strictest_align(rep), unit_align if split else _ALIGN)
        local.append(replace(rep[0], align=base_align))
        local.extend(rep[1:])
    extents = list(field_extents(local))
    unit_bytes = entry_bytes_for(unit_fields) if split else 0
    n_unit = local_units * len(unit_fields)
    # Offsets inside a unit are the same for every unit, since each starts on
    # a multiple of `unit_align`; walking unit 0 alone gives them.
    unit_walk = [replace(f, align=unit_align if j == 0 else f.align) for j, f in enumerate(unit_fields)]
    unit_extents = tuple((start, end - start, f.in_checkpoint)
                         for f, start, end in field_extents(unit_walk))
    rep_ext = tuple((start, end - start, f.in_checkpoint) for f, start, end in extents[n_unit:])
    rep_base = rep_ext[0][0] if rep_ext else local_units * unit_bytes
    entry_bytes = entry_bytes_for(local)
    # Through the entry's trailing pad: the same on every rank (the replicated
    # block starts on the entry's strictest alignment), and it lets a whole
    # replicated entry merge with the next one.
    rep_span = entry_bytes - rep_base if rep_ext else 0
    return ShardGeometry(
        fields=tuple(fields), tp=tp, rank=rank, units=units, unit_bytes=unit_bytes,
        first_unit=first, local_units=local_units, local=tuple(local),
        unit_extents=unit_extents, rep_extents=rep_ext, rep_base=rep_base, rep_span=rep_span,
        entry_bytes=entry_bytes,
    )


class ShardMajorArena(EntryMajorArena):
    """Rank `rank` of `tp`'s part of every entry, laid out head group first.

    `fields` is the GLOBAL declaration (full head counts); the arena holds this
    rank's heads of each split field and all of each replicated one. Entry `i`
    is contiguous at `i * slot_stride`, exactly as in the parent class. After
    construction `declared` is that global list and `fields` the synthesized
    one the bytes follow (`k@3`, ...); `view` answers both kinds of name.
    `buf`, `slot_stride`, `live_entries` and `fill` mean what they mean there.
    """

    kind = "shard_major"

    def __init__(
        self,
        fields: list[EntryField],
        entries: int,
        device: torch.device | str | None,
        *,
        tp: int,
        rank: int,
        buf: torch.Tensor | None = None,
        slot_stride: int | None = None,
        live_entries: int | None = None,
        fill: bool | None = None,
    ) -> None:
        self.geometry = shard_geometry(fields, tp, rank)
        self.declared = list(fields)
        self._split = {f.name: f for f in fields if f.tp_axis is not None}
        super().__init__(list(self.geometry.local), entries, device, buf=buf,
                         slot_stride=slot_stride, live_entries=live_entries, fill=fill)

    @property
    def tp(self) -> int:
        return self.geometry.tp

    @property
    def rank(self) -> int:
        return self.geometry.rank

    def heads(self, name: str) -> tuple[int, int]:
        """`[lo, hi)` of the global heads of split field `name` this rank holds."""
        field = self._split_field(name)
        per_unit = split_heads(field) // self.geometry.units
        g = self.geometry
        return g.first_unit * per_unit, g.end_unit * per_unit

    def _split_field(self, name: str) -> EntryField:
        try:
            return self._split[name]
        except KeyError:
            raise LayoutError(
                f"{name!r} is not a split field of this arena; split fields: {sorted(self._split)}"
            ) from None

    def group_view(self, name: str, group: int) -> torch.Tensor:
        """`[layers, entries, *unit_shape]` of this rank's head group `group` of `name`.

        Dense inside the group (its heads are consecutive), strided by the
        slot across entries: what an NHD kernel takes per head group.
        """
        self._split_field(name)
        g = self.geometry
        if not 0 <= group < g.local_units:
            raise LayoutError(f"head group {group} outside 0..{g.local_units - 1} on this rank")
        return super().view(f"{name}@{g.first_unit + group}")

    def view(self, name: str) -> torch.Tensor:
        """`[layers, entries, *local_shape]`; for a split field, strided across head groups."""
        field = self._split.get(name)
        if field is None:
            return super().view(name)
        g = self.geometry
        base = super().view(f"{name}@{g.first_unit}")
        per_unit = split_heads(field) // g.units
        if g.local_units == 1:
            return base
        if per_unit != 1:
            raise LayoutError(
                f"field {name!r}: {per_unit} heads per head group and {g.local_units} groups on "
                "this rank are not one strided view; take group_view(name, g) per head group"
            )
        axis = 2 + field.tp_axis
        shape, stride = list(base.shape), list(base.stride())
        shape[axis] = g.local_units
        stride[axis] = g.unit_bytes // field.dtype.itemsize
        return base.as_strided(shape, stride, base.storage_offset())

    def field_offset(self, name: str) -> int:
        """Byte offset of a field (a split field: its first head group) in an entry."""
        if name in self._split:
            return super().field_offset(f"{name}@{self.geometry.first_unit}")
        return super().field_offset(name)

    def description(self) -> dict[str, Any]:
        """The global (unsharded) format, plus this rank's split and what it places.

        Two ranks of different splits differ here yet may exchange bytes:
        `describe_diff` compares the global formats and checks each split.
        """
        g = self.geometry
        return {
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "fields": [describe_field(f) for f in self.declared],
            "units": g.units,
            "unit_bytes": g.unit_bytes,
            "tp": {"size": g.tp, "rank": g.rank},
            "entries": self.entries,
            "live_entries": self.live_entries,
            "entry_bytes": self.entry_bytes,
            "slot_stride": self.slot_stride,
            "offsets": {f.name: self.field_offset(f.name) for f in self.fields},
        }
