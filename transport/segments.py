"""Checking segment tables and range lists, vectorised, before any byte moves.

Every backend refuses the same bad input with the same message, so the checks
live here once: a backend calls `check_table` on the sender side (against both
regions' lengths) and, where a receiver re-checks what arrives off the wire
(tcp), `check_ranges` on the `(dst_offset, nbytes)` pairs of one frame. Both
are numpy array arithmetic over the whole table — no Python loop per row —
and both name the first offending row with its numbers and say how many rows
are bad, so a caller can find the bug in its own planning.

Arithmetic overflow is a trap here: `offset + nbytes` can wrap in int64 for a
hostile or garbage row, so ends are compared as `offset > length - nbytes`,
which never overflows once `0 < nbytes <= length` is known.

A table that passes is the common case, and a small one is typical (tens of
rows per request), where numpy's constant cost per call is the bill: so
`check_table` first tries `_accept`, which proves a table good in a handful
of calls (plain ints up to `_TINY` rows) and never words a refusal; anything it
doubts goes through the checks above, which find the first bad row and say
so. Each refusal's message therefore lives in one place.

A table a planner built against lengths it checked once carries that proof
(`CheckedTable`): `check_table` then compares the lengths the proof was made
for with the regions the write names — equal, the table passes without a
row being read again; different, or any other array, the full checks run.

Also here: `split_rows`, which cuts rows into pieces no larger than a cap,
shared by tcp's striping and its bounce-buffer batching.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from operator import itemgetter
from typing import Any

import numpy as np

from .errors import BoundsError, ProtocolError

# A notify payload is a control message, not a data channel: big payloads
# belong in a registered region. Enforced by every backend so code written
# against loopback does not break on tcp.
MAX_NOTIFY = 64 * 1024

# Tables of at most this many rows are accepted in plain int arithmetic: one
# `tolist` and a loop beat `_accept`'s ~20 numpy calls up to a few dozen rows
# (16 rows: 3.1 us against 7.2 us, measured idle).
_TINY = 32
# Region lengths below this keep `offset + nbytes` inside int64 once both
# are known to be at most the length (lengths are real allocations).
_SAFE_LENGTH = 1 << 62
_BY_DST = itemgetter(1)

class CheckedTable(np.ndarray):
    """A read-only segment table whose rows a planner proved in bounds and disjoint.

    Exists so a table is checked once, where the proof is cheap, instead of
    once more per write: an engine that planned it from entry indices it
    range-checked, against a peer descriptor whose bounds it checked at the
    handshake, knows every row lies inside both regions and that no two
    destinations overlap. Only `proven` makes one, and only such planners
    call it; a plain array is always checked in full. Views and slices of it
    carry no proof (numpy makes them without `proof`), and it is read-only,
    so the rows cannot change after the proof was made.
    """

    @classmethod
    def proven(cls, table: np.ndarray, nbytes: int, src_length: int, dst_length: int) -> CheckedTable:
        """`table` (C-contiguous int64 `[n, 3]`) with the lengths its rows were proved within."""
        out = table.view(cls)
        out.flags.writeable = False
        out.proof = (src_length, dst_length, nbytes)
        return out


def as_table(segments: Any) -> np.ndarray:
    """The caller's table as a C-contiguous int64 `[n, 3]` array, or `BoundsError`.

    Exists so every backend accepts exactly what `layout` produces and refuses
    the rest up front: a float table or a `[n, 2]` array is a planning bug,
    not something to coerce silently. An empty `[0, 3]` table is allowed: it
    is a notify-only transfer.
    """
    if not isinstance(segments, np.ndarray):
        raise BoundsError(
            f"segments must be a numpy int64 array [n, 3], got {type(segments).__name__}; "
            "build it with layout.plan_segments or np.asarray(..., dtype=np.int64)"
        )
    if segments.dtype != np.int64:
        raise BoundsError(
            f"segments must have dtype int64, got {segments.dtype}; "
            "convert with segments.astype(np.int64)"
        )
    if segments.ndim != 2 or segments.shape[1] != 3:
        raise BoundsError(
            f"segments must have shape [n, 3] (src_offset, dst_offset, nbytes), "
            f"got {list(segments.shape)}"
        )
    if type(segments) is CheckedTable and getattr(segments, "proof", None) is not None:
        return segments  # made C-contiguous int64 [n, 3] by its planner
    return np.ascontiguousarray(segments)


def _first_bad(mask: np.ndarray) -> tuple[int, int]:
    bad = np.flatnonzero(mask)
    return int(bad[0]), int(bad.size)


def check_table(table: np.ndarray, src_length: int, dst_length: int) -> int:
    """Refuse any row outside either region or any overlap of destinations; return the bytes.

    Checks, in this order, each over the whole table at once: negative
    offsets, non-positive lengths, source ends past `src_length`, destination
    ends past `dst_length`, and destination ranges overlapping one another
    (two rows writing the same byte make the result depend on timing).
    Sources may overlap: reading a byte twice is harmless. A `CheckedTable`
    proved against exactly these two lengths skips the checks.
    """
    if type(table) is CheckedTable:
        proof = getattr(table, "proof", None)
        if proof is not None and proof[0] == src_length and proof[1] == dst_length:
            return proof[2]
    if table.shape[0] == 0:
        return 0
    total = _accept(table, src_length, dst_length)
    if total is not None:
        return total
    src, dst, nbytes = table[:, 0], table[:, 1], table[:, 2]
    for col, name in ((src, "src_offset"), (dst, "dst_offset")):
        neg = col < 0
        if neg.any():
            row, count = _first_bad(neg)
            raise BoundsError(
                f"segment row {row} has negative {name} {int(col[row])} "
                f"({count} row(s) affected); offsets count bytes from the region start"
            )
    empty = nbytes <= 0
    if empty.any():
        row, count = _first_bad(empty)
        raise BoundsError(
            f"segment row {row} has nbytes {int(nbytes[row])} ({count} row(s) affected); "
            "every row must move at least one byte — drop empty rows before posting"
        )
    for col, name, length in ((src, "source", src_length), (dst, "destination", dst_length)):
        past = (nbytes > length) | (col > length - nbytes)
        if past.any():
            row, count = _first_bad(past)
            raise BoundsError(
                f"segment row {row} reads/writes {name} bytes [{int(col[row])}, "
                f"{int(col[row]) + int(nbytes[row])}) past the {name} region's end "
                f"({length} B; {count} row(s) affected); check the entry indices "
                "and the arena the table was planned for"
            )
    _check_disjoint(dst, nbytes, "segment table")
    return int(nbytes.sum())


def _accept(table: np.ndarray, src_length: int, dst_length: int) -> int | None:
    """The bytes of a table that passes every check of `check_table`; None if in doubt.

    Accepts exactly what `check_table` accepts, in about ten numpy calls
    whatever the row count: one min and one max per column prove the offsets
    non-negative, the lengths positive and every value within its region (so
    `offset + nbytes` cannot wrap), one max of the ends bounds them, and the
    destinations are disjoint iff, with starts and ends each sorted, no end
    passes the next start (for non-empty ranges, sorting by start also sorts
    the ends of disjoint ones; and a point covered twice makes some sorted
    end pass the next sorted start).
    """
    if src_length >= _SAFE_LENGTH or dst_length >= _SAFE_LENGTH:
        return None
    if table.shape[0] <= _TINY:
        rows = table.tolist()
        total = 0
        for s, d, n in rows:
            if s < 0 or d < 0 or n <= 0 or s + n > src_length or d + n > dst_length:
                return None
            total += n
        # Sorted by destination start, non-empty ranges are disjoint iff none
        # starts before the previous one ends.
        rows.sort(key=_BY_DST)
        end = 0
        for _, d, n in rows:
            if d < end:
                return None
            end = d + n
        return total
    lo, hi = table.min(axis=0).tolist(), table.max(axis=0).tolist()
    if (lo[0] < 0 or lo[1] < 0 or lo[2] <= 0 or hi[0] > src_length or hi[1] > dst_length
            or hi[2] > src_length or hi[2] > dst_length):
        return None
    ends = table[:, :2] + table[:, 2:]
    reach = ends.max(axis=0).tolist()
    if reach[0] > src_length or reach[1] > dst_length:
        return None
    starts, stops = table[:, 1].copy(), ends[:, 1].copy()
    starts.sort()
    stops.sort()
    if np.count_nonzero(stops[:-1] > starts[1:]):
        return None
    return int(table[:, 2].sum())


def _check_disjoint(starts: np.ndarray, nbytes: np.ndarray, what: str) -> None:
    if starts.shape[0] < 2:
        return
    order = np.argsort(starts, kind="stable")
    s, n = starts[order], nbytes[order]
    clash = s[1:] < s[:-1] + n[:-1]
    if clash.any():
        i, count = _first_bad(clash)
        a, b = int(order[i]), int(order[i + 1])
        raise BoundsError(
            f"{what}: destination rows {a} [{int(s[i])}, {int(s[i]) + int(n[i])}) and "
            f"{b} [{int(s[i + 1])}, {int(s[i + 1]) + int(n[i + 1])}) overlap "
            f"({count} overlap(s)); each destination byte may be written once per transfer"
        )


def check_ranges(ranges: np.ndarray, length: int, what: str) -> int:
    """Refuse a received `[n, 2]` (dst_offset, nbytes) list outside `[0, length)` or overlapping.

    The receiver's half of `check_table`: what a peer claims it is about to
    write is checked against the region we actually registered, before one
    byte of the payload is read. Raises `ProtocolError` because a well-behaved
    sender has already run `check_table`; reaching this means a corrupt or
    hostile peer. Returns the bytes the ranges cover.
    """
    if ranges.shape[0] == 0:
        raise ProtocolError(f"{what}: empty range list")
    off, nbytes = ranges[:, 0], ranges[:, 1]
    bad = (off < 0) | (nbytes <= 0) | (nbytes > length) | (off > length - nbytes)
    if bad.any():
        row, count = _first_bad(bad)
        raise ProtocolError(
            f"{what}: range {row} [{int(off[row])}, +{int(nbytes[row])}) lies outside "
            f"the {length} B region ({count} bad range(s))"
        )
    try:
        _check_disjoint(off, nbytes, what)
    except BoundsError as exc:
        raise ProtocolError(str(exc)) from exc
    return int(nbytes.sum())


def check_notify(notify: Any) -> bytes | None:
    """`notify` as bytes (or None), refusing other types and payloads over `MAX_NOTIFY`."""
    if notify is None:
        return None
    if not isinstance(notify, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"notify must be bytes or None, got {type(notify).__name__}")
    data = bytes(notify)
    if len(data) > MAX_NOTIFY:
        raise ProtocolError(
            f"notify payload of {len(data)} B exceeds {MAX_NOTIFY} B; put bulk data "
            "in a registered region and send only its coordinates"
        )
    return data


def split_rows(table: np.ndarray, cap: int) -> np.ndarray:
    """Cut every row longer than `cap` bytes into consecutive pieces of at most `cap`.

    Works on any table whose last column is `nbytes` and whose other columns
    are offsets (the `[n, 3]` segment table, a receiver's `[n, 2]` ranges).
    Vectorised: each row becomes `ceil(nbytes / cap)` rows whose offsets all
    advance by `cap`. Used to stripe one huge segment over several streams,
    to share it among copy threads, and to fit rows into a bounce buffer.
    """
    if table.shape[0] == 0 or int(table[:, -1].max()) <= cap:
        return table
    pieces = -(-table[:, -1] // cap)
    out = np.repeat(table, pieces, axis=0)
    # index of each piece within its row: 0, 1, ... restarting at each row
    starts = np.cumsum(pieces) - pieces
    within = np.arange(out.shape[0], dtype=np.int64) - np.repeat(starts, pieces)
    shift = within * cap
    out[:, :-1] += shift[:, None]
    out[:, -1] = np.minimum(out[:, -1] - shift, cap)
    return out


def balanced_parts(table: np.ndarray, parts: int) -> list[np.ndarray]:
    """Cut a table into at most `parts` runs of consecutive rows with balanced byte counts.

    Rows longer than a fair share are split first (`split_rows`), so one huge
    segment still spreads over every part; then each run ends at the first
    row whose cumulative bytes reach its share. Never returns an empty run.
    Shared by tcp striping (one run per stream) and loopback's copy threads.
    """
    if 0 < table.shape[0] <= _TINY:  # plain ints: a dozen numpy calls cost more than the rows
        sizes = table[:, -1].tolist()
        total = sum(sizes)
        if parts < 2 or total == 0:
            return [table]
        if max(sizes) <= -(-total // parts):  # no row to split: cut between rows
            cum = list(accumulate(sizes))
            bounds = [0, *(bisect_left(cum, total * k // parts) + 1 for k in range(1, parts)),
                      table.shape[0]]
            return [table[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    total = int(table[:, -1].sum()) if table.shape[0] else 0
    if parts < 2 or total == 0:
        return [table]
    table = split_rows(table, -(-total // parts))
    cum = np.cumsum(table[:, -1])
    targets = total * np.arange(1, parts, dtype=np.int64) // parts
    cuts = np.searchsorted(cum, targets, side="left") + 1
    return [p for p in np.split(table, cuts) if p.shape[0]]
