"""A pool over per-layer tensors a serving engine already allocated.

SGLang's and vLLM's paged KV pools hold one tensor per layer and per K/V
(`k_buffer[l]`, `v_buffer[l]`, each `[rows, H, D]`), allocated before any
transfer engine exists. `PerLayerArena` adopts that memory as ONE pool:
every tensor stays where the engine put it and is one buffer of the pool
(`arena_buffers` lists them, in field order then layer order), so an engine
registers each once, describes the pool once in its handshake, and plans a
request once — `plan_segments` returns one table per tensor from a single
table computed for each field (the tensors of one field share their entry
stride, so their tables are the same rows; they are stamped out with one
broadcast, never a Python loop over layers).

An entry is `entry_rows` consecutive rows of every tensor (a page of
`page_size` tokens). A tensor whose rows are not whole entries is refused
rather than trimmed: the usual cause is a wrong `entry_rows`, and silently
dropping the tail would leave rows the engine writes that no peer ever
fills. A caller whose tail really is padding passes the whole-entry slice.

Every layer must own its bytes: two layers over one byte (the same tensor
twice, overlapping views, K and V on one storage) would each receive the
other's pages and report Success, so that is refused here, naming both
(`aliasing.first_alias`). Views of one allocation that do not overlap are
the carved case and fine.

What this costs on the wire is one segment per tensor per run of pages —
`2 * layers` where an `EntryMajorArena` needs one; docs/per-layer-pools.md
has the numbers and the migration. The arena never writes the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .aliasing import Footprint, first_alias
from .checks import _check_names
from .errors import LayoutError
from .fields import EntryField, _require_int
from .protocol import base_description
from .runs import _plan_slots, check_layers


class PerLayerArena:
    """`{field: [tensor per layer]}` adopted as one pool of `entries` entries.

    `tensors` maps a field name (`"k"`, `"v"`) to the engine's per-layer
    tensors, each `[rows, *shape]`, contiguous, of one dtype and device;
    `entry_rows` rows make an entry (the page size for token-indexed KV, 1
    for a page-indexed pool).
    """

    kind = "per_layer"

    def __init__(self, tensors: Mapping[str, Sequence[torch.Tensor]], entry_rows: int = 1) -> None:
        if not isinstance(tensors, Mapping) or not tensors:
            raise LayoutError("tensors must be a non-empty mapping field name -> per-layer tensors")
        self.entry_rows = _require_int(entry_rows, "entry_rows", minimum=1)
        fields, entries, device = [], None, None
        for name, per_layer in tensors.items():
            per_layer = list(per_layer)
            if not per_layer or not all(isinstance(t, torch.Tensor) for t in per_layer):
                raise LayoutError(f"field {name!r}: give a non-empty list of per-layer tensors")
            first = per_layer[0]
            for layer, t in enumerate(per_layer):
                if t.dim() < 1 or (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
                    raise LayoutError(
                        f"field {name!r} layer {layer}: {list(t.shape)} {t.dtype} on {t.device}, "
                        f"but layer 0 is {list(first.shape)} {first.dtype} on {first.device}; one "
                        "field's tensors must agree (put differing tensors in fields of their own)"
                    )
                if not t.is_contiguous():
                    raise LayoutError(
                        f"field {name!r} layer {layer} is not contiguous; a pool registers each "
                        "tensor as one byte range, so pass the allocation itself"
                    )
            rows = first.shape[0]
            if rows % self.entry_rows:
                whole = rows - rows % self.entry_rows
                raise LayoutError(
                    f"field {name!r} holds {rows} rows, not a multiple of entry_rows="
                    f"{self.entry_rows} ({rows % self.entry_rows} rows left over); pass whole "
                    f"entries, e.g. t[:{whole}], or check entry_rows (the page size)"
                )
            n = rows // self.entry_rows
            if entries is not None and n != entries:
                raise LayoutError(
                    f"field {name!r} holds {n} entries of {self.entry_rows} rows but "
                    f"{fields[0].name!r} holds {entries}; every field of a pool has the same entries"
                )
            if device is not None and first.device != device:
                raise LayoutError(f"field {name!r} is on {first.device}, the others on {device}")
            entries, device = n, first.device
            fields.append(EntryField(name, len(per_layer), (self.entry_rows, *first.shape[1:]),
                                     first.dtype))
        _check_names(fields)
        self.fields: list[EntryField] = fields
        self.entries: int = int(entries)
        self.live_entries = self.entries
        self.device = device
        self._tensors = {name: list(per_layer) for name, per_layer in tensors.items()}
        self._by_name = {f.name: f for f in fields}
        footprints = self.footprints()
        alias = first_alias(footprints)
        if alias is not None:
            i, j, address = alias
            raise LayoutError(
                f"{footprints[j].label} shares memory with {footprints[i].label} (byte "
                f"{address:#x} is in both): each would receive the other's pages; give every "
                "layer its own memory (views of one allocation are fine where they do not overlap)"
            )

    @property
    def entry_bytes(self) -> int:
        """Bytes one entry holds across every tensor (no padding: nothing is interleaved)."""
        return sum(f.bytes_per_entry for f in self.fields)

    def _field(self, name: str) -> EntryField:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutError(f"no field {name!r} in this pool; it has {list(self._by_name)}") from None

    def view(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer` of field `name` as `[entries, entry_rows, *shape]` (the engine's tensor)."""
        field = self._field(name)
        if not 0 <= layer < field.layers:
            raise LayoutError(f"layer {layer} outside 0..{field.layers - 1} of field {name!r}")
        t = self._tensors[name][layer]
        return t[: self.entries * self.entry_rows].view(self.entries, *field.shape)

    def field_offset(self, name: str) -> int:
        """0: every tensor is a buffer of its own, so each field starts its buffers."""
        self._field(name)
        return 0

    def buffers(self) -> list[torch.Tensor]:
        """Each tensor's whole entries as a 1-D uint8 tensor, fields in order, layers in order."""
        out = []
        for field in self.fields:
            span = self.entries * field.per_layer_bytes
            out += [t.reshape(-1).view(torch.uint8)[:span] for t in self._tensors[field.name]]
        return out

    def footprints(self) -> list[Footprint]:
        """Each tensor's bytes, in `buffers()` order, labelled by field and layer."""
        return [Footprint.of_tensor(f"field {f.name!r} layer {layer}", t)
                for f in self.fields for layer, t in enumerate(self._tensors[f.name])]

    # -- the arena protocol (`layout.protocol`); `buffers` and `footprints` are above --

    def index_space(self) -> tuple[int, int]:
        """`(entries, 0)`: every entry may be named."""
        return self.entries, 0

    def strided(self, checkpoint: bool, layers: tuple[int, int] | None) -> None:
        """None: one table per tensor is planned once per field, not per buffer."""
        return None

    def plan(self, pair: np.ndarray, dst_entries: int, checkpoint: bool,
             layers: tuple[int, int] | None) -> list[np.ndarray]:
        """One table per buffer for validated, source-ordered `pair` (`[2, n]` int64).

        One `_plan_slots` call per field (its tensors share the stride), then
        one broadcast copy stamps it out for every layer: distinct arrays,
        since a caller may shift one tensor's table in place. With `layers`,
        the tensors of layers outside `[a, b)` get empty tables (they keep
        their place, so tables and `buffers()` still pair up by position).
        """
        lo, hi = (0, None) if layers is None else check_layers(layers, self.fields)
        tables: list[np.ndarray] = []
        for field in self.fields:
            stride = field.per_layer_bytes
            if (checkpoint and not field.in_checkpoint) or not stride:
                table = np.empty((0, 3), dtype=np.int64)
            else:
                table = _plan_slots(pair, stride, 0, stride)
            stamped = np.empty((field.layers, *table.shape), dtype=np.int64)
            stamped[:] = table
            keep = np.zeros(field.layers, dtype=bool)
            keep[lo:hi] = True
            tables += [t if k else t[:0] for t, k in zip(stamped, keep.tolist(), strict=True)]
        return tables

    def description(self) -> dict[str, Any]:
        """The common keys; no slot stride (each tensor is a buffer of its own)."""
        return base_description(self, None)
