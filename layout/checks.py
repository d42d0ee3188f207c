"""Refusals shared by the arenas: field lists and buffers a caller hands in.

An arena over a caller's memory is the place a user first meets layout's
arithmetic, so its refusals carry the arithmetic: how big an entry is, how
much of that is padding and why. Kept apart from `arenas` so each arena
module (`arenas`, `per_layer`) words these the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import LayoutError
from .fields import EntryField, strictest_align


def _check_names(fields: Sequence[EntryField]) -> None:
    for field in fields:
        if not isinstance(field, EntryField):
            raise LayoutError(f"fields must be EntryField, got {type(field).__name__}")
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise LayoutError(f"duplicate field names {dups} in {names}; every field needs its own name")


def too_small(fields: Sequence[EntryField], entries: int, entry_bytes: int, stride: int,
              have: int, base_align: int) -> str:
    """Why a caller's buffer cannot hold `entries` entries, with the padding spelled out.

    The surprise is always the padding: fields of 600 B make a 768 B entry
    once aligned to 256 B, and a buffer sized `entries * 600` is short.
    """
    payload = sum(f.bytes_per_entry for f in fields)
    align = strictest_align(fields, base_align=base_align)
    want = (entries - 1) * stride + entry_bytes if entries else 0
    gap = f", {stride - entry_bytes} B of slot gap" if stride > entry_bytes else ""
    fits = (have - entry_bytes) // stride + 1 if have >= entry_bytes else 0
    return (
        f"buf holds {have} B but {entries} entries need at least {want} B: an entry is "
        f"{entry_bytes} B = {payload} B of fields + {entry_bytes - payload} B of alignment "
        f"padding (fields start on and the entry rounds up to {align} B){gap}; pass a buffer "
        f"of at least {want} B, or entries={fits} to fit this one"
    )
