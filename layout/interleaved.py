"""Entries ordered layer first: the first layers of every entry are one contiguous prefix.

`EntryMajorArena` keeps an entry contiguous but orders it field first: all
of `k`'s layers, then all of `v`'s. A prefill that has computed layers
`[0, L)` and wants to ship them while it computes the rest would then send
one range per field per entry. `LayerInterleavedArena` orders the same
`EntryField` declarations layer first:

    entry = [layer 0: every field][layer 1: every field] ... [layer D-1: every field]

so layers `[a, b)` of an entry are ONE byte range, `[a * layer_bytes,
b * layer_bytes)`, whichever fields the entry holds, and a streamed request
costs one segment per entry per layer group (runs of entries still coalesce
when the whole entry ships). `layer_ranges(a, b)` is where those ranges come
from: callers name layers, never bytes.

Everything is one walk (`layout.fields.field_extents`) over ONE layer of
every field, in declared order: it gives each field's offset inside a layer
and `layer_bytes` (that walk's aligned size). A field's layer `l` is at
`l * layer_bytes + offset`, the entry is `depth * layer_bytes` (depth: the
deepest field's layer count), and the checkpoint ranges are that walk's
checkpoint ranges repeated per layer and joined. Sizes, offsets, views,
layer ranges and checkpoint ranges are all read off it, so they cannot drift.
Everything else (slots, live entries, fills, buffers, planning) is
`EntryMajorArena`'s, inherited: this class overrides only the walk and the
layer stride.

Trade-offs, stated:
- Fields with different layer counts interleave by layer index: layer `l`
  holds layer `l` of every field, and a field with fewer layers than the
  deepest leaves its slot in the later layers as zeroed padding. That costs
  `sum((depth - f.layers) * f's slot)` bytes per entry and buys one constant
  layer stride per field, hence one strided view. Packing the absent slots
  out would make a field's layer stride change from one layer to the next,
  and its view a list of tensors.
- What kernels see: `view(name)` keeps the `[layers, entries, *shape]`
  signature, STRIDED twice: layers `layer_bytes` apart (not one field-layer
  block apart) and entries a slot apart. Torch ops and kernels that take
  strides use it as is; a kernel assuming a dense `[layers, entries, ...]`
  tensor, or a dense per-layer `[entries, ...]` slice, must be checked.
- A checkpoint that leaves a field out (`in_checkpoint=False`) is one range
  per layer at least, since the left-out field sits inside every layer; the
  entry-major arena makes it one range per carried run of fields. With every
  field carried it is one range, as there.
- Shipping a layer range of an entry-major arena is one range per field per
  entry; here it is one per entry. Whole entries cost the same in both.

The description's `kind` (`layer_interleaved`) and `layer_bytes` differ
from an entry-major arena of the same fields, so a handshake between the
two orderings is refused by `describe_diff`, naming the kind.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .arenas import EntryMajorArena
from .errors import LayoutError
from .fields import (
    EntryField,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    strictest_align,
)
from .runs import check_layers


class LayerInterleavedArena(EntryMajorArena):
    """`entries` contiguous entries, each ordered layer first, then field.

    Takes what `EntryMajorArena` takes (`buf`, `slot_stride`, `live_entries`,
    `fill` mean what they mean there). `layer_bytes` is one layer of every
    field, aligned; `layers` the deepest field's layer count; an entry is
    `layers * layer_bytes`.
    """

    kind = "layer_interleaved"

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
        if not fields:
            raise LayoutError("a layer-interleaved arena needs at least one field")
        super().__init__(fields, entries, device, buf, slot_stride, live_entries, fill=fill)

    def _walk(self, base_align: int) -> tuple[int, int, dict[str, int], list[tuple[int, int]]]:
        """The one walk over one layer of every field, repeated `layers` times."""
        one = [replace(f, layers=1) for f in self.fields]
        extents = list(field_extents(one, base_align=base_align))
        self.layer_bytes = entry_bytes_for(one, base_align=base_align)
        self.layers = max(f.layers for f in self.fields)
        # A field with no bytes leaves nothing out, so it must not split a run
        # (repeated per layer, a split run would be one more range per layer).
        carry = [f if f.per_layer_bytes else replace(f, in_checkpoint=True) for f in one]
        ranges = checkpoint_ranges_for(carry, base_align=base_align)
        # The layer's trailing padding joins a carried last field's range, so
        # that with every field carried consecutive layers touch and the whole
        # checkpoint is one range (padding travels, as between fields).
        if ranges:
            off, n = ranges[-1]
            if not any(start >= off + n and end > start and not f.in_checkpoint
                       for f, start, end in field_extents(carry, base_align=base_align)):
                ranges[-1] = (off, self.layer_bytes - off)
        self._layer_ckpt = np.array(ranges, dtype=np.int64).reshape(-1, 2)
        offsets = {f.name: start for f, start, _ in extents}
        ckpt = self._layer_spans(0, self.layers, True) if self.layers else []
        return (self.layers * self.layer_bytes, strictest_align(one, base_align=base_align),
                offsets, ckpt)

    def _layer_stride(self, field: EntryField) -> int:
        return self.layer_bytes

    def _layer_spans(self, a: int, b: int, checkpoint: bool) -> list[tuple[int, int]]:
        if not checkpoint:
            return [(a * self.layer_bytes, (b - a) * self.layer_bytes)]
        per = self._layer_ckpt
        if not per.shape[0]:
            return []
        offs = (np.arange(a, b, dtype=np.int64)[:, None] * self.layer_bytes + per[:, 0]).ravel()
        lens = np.tile(per[:, 1], b - a)
        starts = np.flatnonzero(np.concatenate(([True], offs[1:] != offs[:-1] + lens[:-1])))
        return list(zip(offs[starts].tolist(), np.add.reduceat(lens, starts).tolist(), strict=True))

    def layer_ranges(self, a: int, b: int, *, checkpoint: bool = False) -> list[tuple[int, int]]:
        """`(offset, nbytes)` of one entry holding layers `a..b-1` of every field.

        One range (a prefix of the entry when `a == 0`); with `checkpoint=True`
        only the carried fields' bytes, which is one range per layer when a
        field is left out. Refuses `(a, b)` outside `0 <= a < b <= layers`.
        """
        a, b = check_layers((a, b), self.fields)
        return self._layer_spans(a, b, checkpoint)

    def _spans(self, checkpoint: bool, layers: tuple[int, int] | None) -> list[tuple[int, int]]:
        if layers is None:
            return self.checkpoint_ranges if checkpoint else [(0, self.entry_bytes)]
        return self._layer_spans(*layers, checkpoint)

    def description(self) -> dict[str, Any]:
        """The entry-major keys under this kind, plus `layer_bytes` (the ordering's stride)."""
        desc = super().description()
        desc["layer_bytes"] = self.layer_bytes
        return desc
