"""The layer axis outermost: today's paged-KV shape, as an arena.

`LayerMajorArena` reads the same field list `EntryMajorArena` does with the
layer axis outside the entry axis, so one layer's slice of a field is
contiguous (what several attention kernels bind) and an entry is NOT: its
bytes sit one field x layer apart, which is why there is no `entry(i)` and
why shipping a run of entries costs one segment per field x layer x run.
Deletion condition: once paged pools are block-major, `EntryMajorArena`
(or `LayerInterleavedArena`) serves them and this module goes.

Its own module (it was in `arenas`) because it shares no code path with the
entry-major kinds beyond `layout.fields`' walk, and each kind now carries its
own answers to the arena protocol (`layout.protocol`).
"""

from __future__ import annotations

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
    carve,
    check_buffer,
    entry_bytes_for,
    field_extents,
    field_view,
    strictest_align,
)
from .protocol import base_description
from .runs import _empty, _merge, check_layers


class LayerMajorArena:
    """The same fields with the layer axis outermost: today's paged-KV shape.

    Field `f`'s region starts at its `field_extents` offset *times* `entries`
    (the same walk, scaled by the axis that moved outside), with layer `l`,
    entry `i` at `+ (l * entries + i) * per_layer_bytes`.

    Fills only an allocation it owns: a caller's buffer may already hold KV
    (an IPC-imported one does), so a non-zero fill over one is refused rather
    than applied or dropped (a `-inf` score arriving as 0.0 turns "never
    selected" into "always").
    """

    kind = "layer_major"

    def __init__(
        self,
        fields: list[EntryField],
        entries: int,
        device: torch.device | str | None,
        buf: torch.Tensor | None = None,
    ) -> None:
        if not fields:
            raise LayoutError("a layer-major arena needs at least one field")
        _check_names(fields)
        self.fields = list(fields)
        self.entries = _require_int(entries, "entries")
        self.live_entries = self.entries
        self.entry_bytes = entry_bytes_for(self.fields)
        self._align = strictest_align(self.fields)
        self._offsets = {f.name: start for f, start, _ in field_extents(self.fields)}
        self._by_name = {f.name: f for f in self.fields}
        want = self.total_bytes
        if buf is None:
            self.buf = torch.zeros(want, dtype=torch.uint8, device=device)
            for field in self.fields:
                self.view(field.name).fill_(field.fill)
        else:
            if isinstance(buf, torch.Tensor) and buf.dim() == 1 and buf.numel() < want:
                raise LayoutError(too_small(self.fields, self.entries, self.entry_bytes,
                                            self.entry_bytes, buf.numel(), _ALIGN))
            check_buffer(buf, want, self._align)
            unfillable = [f.name for f in self.fields if f.fill]
            if unfillable:
                raise LayoutError(
                    f"fields {unfillable} declare a non-zero fill, which an arena over a "
                    "caller's buffer cannot apply; fill the buffer yourself and declare "
                    "fill=0.0, or let the arena own its buffer"
                )
            self.buf = buf
        for field in self.fields:
            self.view(field.name)  # validates every field against the buffer

    @property
    def total_bytes(self) -> int:
        """Bytes the whole arena spans."""
        return self.entry_bytes * self.entries

    def region_offset(self, name: str) -> int:
        """Byte offset of field `name`'s whole `[layers, entries, ...]` region."""
        return self._offsets[self._field(name).name] * self.entries

    def _field(self, name: str) -> EntryField:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutError(
                f"no field {name!r} in this arena; it has {list(self._by_name)}"
            ) from None

    def view(self, name: str) -> torch.Tensor:
        """`[layers, entries, *shape]`, the signature `EntryMajorArena` gives,
        contiguous per layer, which is what the paged path binds."""
        field = self._field(name)
        return field_view(
            self.buf,
            field,
            self.entries,
            offset=self._offsets[name] * self.entries,
            layer_stride=self.entries * field.per_layer_bytes,
            entry_stride=field.per_layer_bytes,
        )

    def field_offset(self, name: str) -> int:
        """Offset of field `name` in the entry walk (its region starts at this × entries)."""
        return self._offsets[self._field(name).name]

    # -- the arena protocol (`layout.protocol`) --

    def buffers(self) -> list[torch.Tensor]:
        """The one buffer every field's region lives in."""
        return [self.buf]

    def footprints(self) -> list[Footprint]:
        """Every byte of the arena: a peer writes any entry's rows of every region."""
        return [Footprint.of_tensor("", self.buf[:self.total_bytes])]

    def index_space(self) -> tuple[int, int]:
        """`(entries, 0)`: every entry may be named."""
        return self.entries, 0

    def strided(self, checkpoint: bool, layers: tuple[int, int] | None) -> None:
        """None: an entry is not one range per buffer here."""
        return None

    def plan(self, pair: np.ndarray, dst_entries: int, checkpoint: bool,
             layers: tuple[int, int] | None) -> list[np.ndarray]:
        """One row per field x layer x run of entries consecutive on both sides, merged."""
        lo, hi = (0, None) if layers is None else check_layers(layers, self.fields)
        src, dst = pair
        if src.size == 0:
            return [_empty()]
        cont = (src[1:] == src[:-1] + 1) & (dst[1:] == dst[:-1] + 1)
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        run_len = np.diff(np.append(starts, src.size))
        run_src, run_dst = src[starts], dst[starts]
        parts = []
        for field in self.fields:
            nbytes = field.per_layer_bytes
            top = field.layers if hi is None else min(hi, field.layers)
            if (checkpoint and not field.in_checkpoint) or not nbytes or top <= lo:
                continue
            offset = self.field_offset(field.name)
            layer = np.arange(lo, top, dtype=np.int64)[:, None]
            s = offset * self.entries + (layer * self.entries + run_src) * nbytes
            d = offset * dst_entries + (layer * dst_entries + run_dst) * nbytes
            parts.append((s.ravel(), d.ravel(), np.tile(run_len * nbytes, top - lo)))
        if not parts:
            return [_empty()]
        return [_merge(*(np.concatenate(col) for col in zip(*parts, strict=True)))]

    def description(self) -> dict[str, Any]:
        """The common keys; no slot stride (entries are not one stride apart)."""
        return base_description(self, None)


def carve_layer_major(
    groups: list[list[EntryField]],
    entries: int,
    device: torch.device | str | None,
    buf: torch.Tensor | None = None,
) -> list[LayerMajorArena | None]:
    """One layer-major arena per field group, packed into one allocation.

    A paged pool is several groups laid out apart but bought together (a
    block's cache, its scales, an indexer's keys). Each group starts on its
    strictest field alignment, so its views retype; an empty group gets
    `None`. `buf` is None for a pool that owns its memory.
    """
    _require_int(entries, "entries")
    sizes = [entry_bytes_for(group) * entries for group in groups]
    aligns = [strictest_align(group) for group in groups]
    return [
        LayerMajorArena(group, entries, device, buf=region) if group else None
        for group, region in zip(groups, carve(buf, sizes, aligns), strict=True)
    ]
