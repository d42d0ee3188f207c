"""Where in memory an arena's entries live, and whether two such places share a byte.

A destination byte that two layers (or two pools) both own receives whichever
write lands last: the request that loses reports Success holding the other's
bytes, and which one wins depends on the backend's ordering. Nothing
downstream can notice, so it is refused where the memory is adopted —
`PerLayerArena` for its own tensors, the engine's pool registration for
everything it registers (#25).

A `Footprint` is what a peer may write in one buffer: `count` byte ranges of
`length`, `stride` apart (an entry-major arena's live entries), or one dense
range. Comparing footprints, not buffers, is the point: pools interleaved in
one plane (state at the front of each slot, pages behind it) span the same
bytes yet never share one, and stay accepted. The exact test walks the
smaller footprint's ranges as one numpy computation, once, at construction.

Addresses are `data_ptr()`s, compared per device; a `meta` tensor has no
memory and no footprint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Footprint:
    """`count` ranges of `length` bytes, `stride` apart from `start`, on `device`; named `label`."""

    label: str
    device: str
    start: int
    stride: int
    length: int
    count: int

    @classmethod
    def of(cls, label: str, device: str, start: int, stride: int, length: int,
           count: int) -> Footprint:
        """Normalized: ranges that touch or overlap each other become one dense range."""
        if count > 1 and stride <= length:
            length, count = (count - 1) * stride + length, 1
        if count <= 1:
            stride = length
        return cls(label, device, start, stride, length, count)

    @classmethod
    def of_tensor(cls, label: str, t: torch.Tensor) -> Footprint:
        """Every byte of a contiguous tensor."""
        return cls.of(label, str(t.device), int(t.data_ptr()), 0, t.numel() * t.element_size(), 1)

    @property
    def end(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.length

    @property
    def empty(self) -> bool:
        return self.count == 0 or self.length == 0 or self.device == "meta"


def _shared_byte(a: Footprint, b: Footprint) -> int | None:
    """An address both footprints hold, or None; exact for any strides."""
    if a.count > b.count:
        a, b = b, a
    lo = a.start + np.arange(a.count, dtype=np.int64) * a.stride
    hi = lo + a.length
    # b's ranges that can meet [lo, hi): start < hi and start + length > lo
    first = np.maximum(0, (lo - b.length - b.start) // b.stride + 1)
    last = np.minimum(b.count - 1, (hi - b.start - 1) // b.stride)
    hit = np.flatnonzero(first <= last)
    if not hit.size:
        return None
    k = int(hit[0])
    return max(int(lo[k]), b.start + int(first[k]) * b.stride)


def first_alias(footprints: Sequence[Footprint]) -> tuple[int, int, int] | None:
    """`(i, j, address)` with `i < j` for the first pair sharing a byte (smallest `j`), or None.

    The bounding spans are compared all at once; only pairs whose spans meet
    get the exact test, which for dense ranges is the same answer.
    """
    live = [k for k, f in enumerate(footprints) if not f.empty]
    if len(live) < 2:
        return None
    fps = [footprints[k] for k in live]
    devices = {d: n for n, d in enumerate(sorted({f.device for f in fps}))}
    dev = np.array([devices[f.device] for f in fps])
    start = np.array([f.start for f in fps], dtype=np.int64)
    end = np.array([f.end for f in fps], dtype=np.int64)
    meet = (dev[:, None] == dev[None, :]) & (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
    for j, i in sorted(zip(*np.nonzero(np.tril(meet, -1)), strict=True)):
        address = _shared_byte(fps[i], fps[j])
        if address is not None:
            return live[i], live[j], address
    return None
