"""What every arena kind answers, so layout's planners and describers never ask which kind.

`plan_segments`, `arena_buffers`, `arena_footprints`, `check_indices` and
`describe` used to dispatch on the arena's class; each now asks the arena
through `Arena`, and a new kind implements these members in its own module
and touches no dispatcher:

- `buffers()`: the uint8 buffers its bytes live in (what a transport registers);
- `footprints()`: per buffer, the bytes a peer may write (live entries only);
- `index_space()`: `(entries, first_live)`, the indices a request may name;
- `strided(checkpoint, layers)`: per buffer, `(slot_stride, ranges)` when an
  entry's bytes are `ranges` at `index * slot_stride` in every buffer, else
  None: the small-request fast path plans those in plain ints;
- `plan(pair, dst_entries, checkpoint, layers)`: one segment table per buffer
  for validated, source-ordered index pairs, optionally only layers `[a, b)`;
- `description()`: the plain dict `describe` returns (the handshake's facts).

Also here, because every kind's `description` needs them and none may import
`describe` (which dispatches to them): `FORMAT_VERSION`, `describe_field` and
`base_description`, the keys every non-sharded kind shares.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .aliasing import Footprint
from .fields import EntryField

# Bump when the meaning of a description (or the arithmetic behind it) changes,
# so a peer running other layout code cannot match by accident.
FORMAT_VERSION = 1


@runtime_checkable
class Arena(Protocol):
    """The members every arena kind has; `isinstance(x, Arena)` tells an arena from anything else."""

    kind: str
    entries: int
    live_entries: int

    @property
    def fields(self) -> list[EntryField]: ...

    @property
    def entry_bytes(self) -> int: ...

    def field_offset(self, name: str) -> int: ...

    def buffers(self) -> list[torch.Tensor]: ...

    def footprints(self) -> list[Footprint]: ...

    def index_space(self) -> tuple[int, int]: ...

    def strided(self, checkpoint: bool,
                layers: tuple[int, int] | None) -> list[tuple[int, list[tuple[int, int]]]] | None: ...

    def plan(self, pair: np.ndarray, dst_entries: int, checkpoint: bool,
             layers: tuple[int, int] | None) -> list[np.ndarray]: ...

    def description(self) -> dict[str, Any]: ...


def describe_field(field: EntryField) -> dict[str, Any]:
    """One field's every attribute as plain data (dtype by name, one NaN)."""
    fill = float(field.fill)
    desc = {
        "name": field.name,
        "layers": field.layers,
        "shape": list(field.shape),
        "dtype": str(field.dtype),
        # One NaN, so the hash does not depend on a payload nobody chose.
        "fill": math.nan if math.isnan(fill) else fill,
        "align": field.align,
        "in_checkpoint": field.in_checkpoint,
    }
    # Only when set, so every description written before TP splits keeps its hash.
    if field.tp_axis is not None:
        desc["tp_axis"] = field.tp_axis
    return desc


def base_description(arena: Arena, slot_stride: int | None) -> dict[str, Any]:
    """The keys every non-sharded kind describes, in the order they always had."""
    return {
        "version": FORMAT_VERSION,
        "kind": arena.kind,
        "fields": [describe_field(f) for f in arena.fields],
        "entries": arena.entries,
        "live_entries": arena.live_entries,
        "entry_bytes": arena.entry_bytes,
        "slot_stride": slot_stride,
        "offsets": {f.name: arena.field_offset(f.name) for f in arena.fields},
    }
