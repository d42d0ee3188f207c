"""Small requests planned in plain ints: what `segments.plan_segments` does first.

A request typically names tens of pages and one state entry; there numpy's
constant cost per call, not the work, is the bill (each call ~0.5-2 us
whatever its size), so `_plan_tiny` builds the tables with Python ints and
one conversion. It only ever accepts: a request it doubts goes down the
vectorised path in `segments`, which words every refusal — one place states
each rule's message. Kept apart from `segments` so that module stays the
vectorised planner.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from .runs import _empty

# At most this many pairs plan in plain ints (`_plan_tiny`) whatever their
# ranges: a state entry or a decode step's page; with one range per entry, up
# to `segments._SMALL` (16 scattered pages: ~11 us against ~19 us for the vectorised
# path, measured side by side). Each numpy call costs ~0.5-2 us whatever its size.
_TINY = 3


def _plan_tiny(
    planes: list[tuple[int, list[tuple[int, int]]]], src: np.ndarray, dst: np.ndarray,
    live: tuple[int, int], dst_entries: int,
) -> list[np.ndarray] | None:
    """`plan_segments`' tables for small requests, in plain ints; None if in doubt.

    Takes up to `_TINY` pairs whatever the ranges, and up to `segments._SMALL` (its caller's limit) where
    each entry ships one range (the common case: whole entries). Accepts only
    what the vectorised path accepts and returns the same tables (same
    merging, same source order, stable among repeated sources). Any index it
    does not like sends the request down that path, which refuses it with the
    position and value — so this never words a refusal itself.

    `planes` is the arena's `strided` answer: per buffer, the slot stride and
    the ranges every entry ships of its slot.
    """
    spans = [[(o, n) for o, n in ranges if n > 0] for _, ranges in planes]
    if len(src) > _TINY and any(len(r) > 1 for r in spans):
        return None
    dl = dst.tolist()
    pairs = sorted(zip(src.tolist(), dl, strict=True), key=itemgetter(0))
    first_live, entries = live
    if pairs and (pairs[0][0] < first_live or pairs[-1][0] >= entries or min(dl) < 0
                  or max(dl) >= dst_entries or len(set(dl)) != len(dl)):
        return None
    tables = []
    for (stride, _), ranges in zip(planes, spans, strict=True):
        if len(ranges) == 1:
            flat = _one_range(pairs, stride, *ranges[0])
        else:
            rows: list[list[int]] = []
            for s, d in pairs:
                for off, n in ranges:
                    a, b = s * stride + off, d * stride + off
                    if rows and rows[-1][0] + rows[-1][2] == a and rows[-1][1] + rows[-1][2] == b:
                        rows[-1][2] += n
                    else:
                        rows.append([a, b, n])
            flat = [v for row in rows for v in row]
        # From a flat list: numpy converts one several times faster than nested rows.
        tables.append(np.array(flat, dtype=np.int64).reshape(-1, 3) if flat else _empty())
    return tables


def _one_range(pairs: list[tuple[int, int]], stride: int, off: int, n: int) -> list[int]:
    """`_plan_slots`' rows for source-ordered int pairs, flattened: one range per entry.

    As there: only a whole slot (`n == stride`) can continue the previous row,
    and only when both indices step by one.
    """
    if n != stride:
        return [v for s, d in pairs for v in (s * stride + off, d * stride + off, n)]
    flat: list[int] = []
    ps = pd = -2  # no index is -1: the first pair never continues
    for s, d in pairs:
        if s == ps + 1 and d == pd + 1:
            flat[-1] += n
        else:
            flat += (s * stride + off, d * stride + off, n)
        ps, pd = s, d
    return flat
