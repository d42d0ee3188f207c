"""Hypothesis strategies and brute-force references shared by the layout tests.

The references here are written the slow, obvious way (a Python loop per
entry, per layer, per byte) on purpose: the code under test is vectorised,
and a property test is only as good as an oracle that cannot share its bugs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from pdxfer.layout import EntryField

# Small example counts and no deadline: the whole layout suite must stay fast
# on a shared 2-core machine, and torch's first call per dtype is slow.
FAST = settings(max_examples=60, deadline=None)

DTYPES = [torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float32, torch.float64]
FLOAT_FILLS = [0.0, 1.5, -2.0, float("-inf")]
INT_FILLS = [0.0, 3.0, -1.0]


@st.composite
def field(draw: st.DrawFn, name: str) -> EntryField:
    dtype = draw(st.sampled_from(DTYPES))
    fills = FLOAT_FILLS if dtype.is_floating_point else INT_FILLS
    if dtype is torch.uint8:
        fills = [0.0, 7.0]
    return EntryField(
        name=name,
        layers=draw(st.integers(0, 3)),
        shape=tuple(draw(st.lists(st.integers(0, 5), max_size=2))),
        dtype=dtype,
        fill=draw(st.sampled_from(fills)),
        align=draw(st.sampled_from([0, 0, 256, 512, 1024])),
        in_checkpoint=draw(st.booleans()),
    )


@st.composite
def field_lists(draw: st.DrawFn, min_size: int = 0, max_size: int = 5) -> list[EntryField]:
    count = draw(st.integers(min_size, max_size))
    return [draw(field(f"f{i}")) for i in range(count)]


def extents_by_hand(fields: list[EntryField]) -> list[tuple[int, int]]:
    """`[start, end)` of each field, placed by the entry-arena design's align-place-advance rule."""
    out, offset = [], 0
    for f in fields:
        align = max(256, f.align)
        offset = -(-offset // align) * align
        size = f.layers * math.prod(f.shape) * f.dtype.itemsize
        out.append((offset, offset + size))
        offset += size
    return out


def field_bytes(f: EntryField, values: torch.Tensor, layer: int, entry: int) -> torch.Tensor:
    """The raw bytes of `values[layer, entry]` as one contiguous uint8 row."""
    return values[layer, entry].contiguous().reshape(-1).view(torch.uint8)


def expand(rows: np.ndarray) -> np.ndarray:
    """Every byte a table moves, as sorted `(src_byte, dst_byte)` pairs."""
    pairs = [
        np.stack([np.arange(s, s + n), np.arange(d, d + n)], axis=1)
        for s, d, n in rows.tolist()
    ]
    if not pairs:
        return np.empty((0, 2), dtype=np.int64)
    out = np.concatenate(pairs)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct-ish non-zero values of `dtype`, exactly representable in it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 100, shape, generator=gen).to(dtype)
