"""The tcp data path's mechanics: vectored send/recv loops, striping, batching, bounce.

Kept apart from the connection logic because this is where the bytes-per-
second is won: a 4 KiB segment must not cost a system call of its own, so
both sides hand the kernel hundreds of buffers per call (`sendmsg`,
`recvmsg_into`, at most IOV_MAX at a time), and a partial call resumes
mid-buffer by bisecting cumulative byte counts instead of walking the list.
Striping cuts one transfer into byte-balanced shares, one per stream, because
one TCP stream is bound to one core's worth of copying.

The one copy tcp cannot avoid — CUDA bytes through pinned host memory — is
`bounce.py`'s: one bounded pool per engine, whose slots `batches` fills.
"""

from __future__ import annotations

import bisect
import itertools
import os
import socket
from collections.abc import Callable, Iterator

import numpy as np

from ..segments import balanced_parts

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Below this a transfer goes whole on one stream: splitting costs more
# frames and wake-ups than a second stream saves.
STRIPE_MIN = 512 * 1024


def _ends(buffers: list[memoryview], sizes: list[int] | None) -> list[int]:
    return list(itertools.accumulate(sizes if sizes is not None else [b.nbytes for b in buffers]))


def send_all(sock: socket.socket, buffers: list[memoryview], sizes: list[int] | None = None,
             pace: Callable[[], None] | None = None) -> None:
    """Send every buffer, in order, with as few `sendmsg` calls as the kernel allows.

    `sizes` (each buffer's byte count) may be passed when the caller already
    has them, sparing a pass over the buffers. `pace`, if given, is called
    before each call (a bounce slot's deadline: `Bounce.held_for`).
    """
    ends = _ends(buffers, sizes)
    total = ends[-1] if ends else 0
    pos = i = 0
    first = buffers[0] if buffers else None
    while pos < total:
        if pace is not None:
            pace()
        sent = sock.sendmsg([first, *buffers[i + 1:i + IOV_MAX]])
        pos += sent
        i = bisect.bisect_right(ends, pos)
        if i < len(buffers):
            start = ends[i - 1] if i else 0
            first = buffers[i][pos - start:]


def recv_all(sock: socket.socket, buffers: list[memoryview], sizes: list[int] | None = None,
             pace: Callable[[], None] | None = None) -> int:
    """Fill every buffer, in order, with as few `recvmsg_into` calls as the kernel allows.

    Returns the bytes received; raises `ConnectionError` at EOF (callers
    translate it), since a stream never ends mid-payload on purpose. `pace`
    as in `send_all`.
    """
    ends = _ends(buffers, sizes)
    total = ends[-1] if ends else 0
    pos = i = 0
    first = buffers[0] if buffers else None
    while pos < total:
        if pace is not None:
            pace()
        # MSG_WAITALL: the kernel fills the whole list before returning, so a
        # batch costs one call instead of one per socket-buffer's worth.
        got = sock.recvmsg_into([first, *buffers[i + 1:i + IOV_MAX]], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError(f"peer closed the stream after {pos}/{total} payload bytes")
        pos += got
        i = bisect.bisect_right(ends, pos)
        if i < len(buffers):
            start = ends[i - 1] if i else 0
            first = buffers[i][pos - start:]
    return total


def slices(view: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> tuple[list[memoryview], list[int]]:
    """The buffers (and their sizes) covering `view` at these ranges, in order.

    Rows adjacent in *this* buffer are merged first (vectorised): a stream is
    just bytes, so a sender whose sources run on, or a receiver whose
    destinations do, hands the kernel one buffer where the table has many —
    whatever the other side's layout. Slicing goes through `map` so no
    Python bytecode runs per row.
    """
    if offsets.shape[0] > 1:
        brk = np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1
        if brk.shape[0] + 1 < offsets.shape[0]:
            starts = np.concatenate(([0], brk))
            stops = np.concatenate((brk, [offsets.shape[0]]))
            cum = np.concatenate(([0], np.cumsum(lengths)))
            offsets, lengths = offsets[starts], cum[stops] - cum[starts]
    sizes = lengths.tolist()
    ends = (offsets + lengths).tolist()
    return list(map(view.__getitem__, map(slice, offsets.tolist(), ends))), sizes


def plan_stripes(table: np.ndarray, streams: int) -> list[np.ndarray]:
    """Cut a transfer's rows into at most `streams` byte-balanced shares (never empty ones).

    A share is a run of consecutive rows; a row bigger than a share is split
    first, so one 256 MiB segment still spreads over every stream. Transfers
    under `2 * STRIPE_MIN` stay whole, as does the empty (notify-only) table.
    """
    total = int(table[:, 2].sum()) if table.shape[0] else 0
    return balanced_parts(table, min(streams, total // STRIPE_MIN))


def batches(rows: np.ndarray, max_rows: int, max_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive slices of `rows` with at most `max_rows` rows and (if given) `max_bytes` bytes.

    `nbytes` is the last column (segment tables and receiver ranges alike).
    With `max_bytes`, rows must already be no longer than it (see `split_rows`).
    """
    n = rows.shape[0]
    if max_bytes is None:
        for start in range(0, n, max_rows):
            yield rows[start:start + max_rows]
        return
    cum = np.cumsum(rows[:, -1])
    start = 0
    while start < n:
        base = int(cum[start - 1]) if start else 0
        stop = int(np.searchsorted(cum, base + max_bytes, side="right"))
        stop = min(max(stop, start + 1), start + max_rows, n)
        yield rows[start:stop]
        start = stop
