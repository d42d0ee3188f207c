"""Segment-table arithmetic over index pairs: the numpy kernels every arena kind plans with.

An arena kind knows where an entry's bytes are; turning that into rows of
`(src_offset, dst_offset, nbytes)` for a set of entries is the same few
vectorised operations whichever kind asks, so they live here, below the
arenas, and each kind's `plan` calls them. Python loops here run over an
entry's handful of ranges, never over entries or layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import LayoutError
from .fields import EntryField


def _empty() -> np.ndarray:
    return np.empty((0, 3), dtype=np.int64)


def _merge(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Rows (in table order) joined wherever a row continues the previous on both sides."""
    if src.size == 0:
        return _empty()
    cont = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:, 2] = nbytes[starts] if starts.size == src.size else np.add.reduceat(nbytes, starts)
    return out


def _plan_strided(pair: np.ndarray, stride: int, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Entry `i`'s ranges at `i * stride + offset` on both sides, merged."""
    ranges = [(o, n) for o, n in ranges if n > 0]
    if not ranges or pair.shape[1] == 0:
        return _empty()
    if len(ranges) == 1:
        (off, n), = ranges
        return _plan_slots(pair, stride, off, n)
    offs = np.array([o for o, _ in ranges], dtype=np.int64)
    s = (pair[0][:, None] * stride + offs).ravel()
    d = (pair[1][:, None] * stride + offs).ravel()
    nbytes = np.tile(np.array([n for _, n in ranges], dtype=np.int64), pair.shape[1])
    return _merge(s, d, nbytes)


def _plan_slots(pair: np.ndarray, stride: int, off: int, n: int) -> np.ndarray:
    """One range `[off, off + n)` per entry: `_merge`'s table, with runs found on the indices.

    Row `k + 1` continues row `k` only when `(src[k+1] - src[k]) * stride == n`;
    as `0 < n <= stride`, that is `n == stride` and both indices step by one.
    So a range narrower than the slot never merges, and a whole slot merges
    exactly the runs of entries consecutive on both sides.
    """
    size = pair.shape[1]
    nbytes: int | np.ndarray = n
    if n == stride and size > 1:
        brk = (pair[:, 1:] - pair[:, :-1]) != 1
        brk = brk[0] | brk[1]
        if np.count_nonzero(brk) < size - 1:
            starts = np.flatnonzero(np.concatenate(([True], brk)))
            nbytes = np.diff(np.append(starts, size)) * n
            pair = pair.take(starts, axis=1)
    out = np.empty((pair.shape[1], 3), dtype=np.int64)
    out[:, :2] = (pair * stride + off if off else pair * stride).T
    out[:, 2] = nbytes
    return out


def join_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`(offset, nbytes)` ranges in order, empty ones dropped, touching ones joined."""
    out: list[tuple[int, int]] = []
    for off, n in ranges:
        if not n:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def check_layers(layers: object, fields: Sequence[EntryField]) -> tuple[int, int]:
    """`layers` as a validated `(a, b)` with `0 <= a < b <= deepest field's layers`."""
    depth = max((f.layers for f in fields), default=0)
    try:
        a, b = layers  # type: ignore[misc]
        ok = all(type(x) is int or isinstance(x, np.integer) for x in (a, b))
    except (TypeError, ValueError):
        ok = False
    if not ok or not 0 <= a < b <= depth:
        raise LayoutError(
            f"layers must be a pair (a, b) of ints with 0 <= a < b <= {depth} (the deepest "
            f"field's layer count), got {layers!r}"
        )
    return int(a), int(b)
