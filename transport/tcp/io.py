"""The tcp data path's mechanics: vectored send/recv loops, striping, batching, bounce.

Kept apart from the connection logic because this is where the bytes-per-
second is won: a 4 KiB segment must not cost a system call of its own, so
both sides hand the kernel hundreds of buffers per call (`sendmsg`,
`recvmsg_into`, at most IOV_MAX at a time), and a partial call resumes
mid-buffer by bisecting cumulative byte counts instead of walking the list.
Striping cuts one transfer into byte-balanced shares, one per stream, because
one TCP stream is bound to one core's worth of copying.

`Bounce` is the one copy tcp cannot avoid: a socket reads and writes host
memory, so CUDA bytes pass through a pinned host buffer of fixed size, in
batches that fit it, each moved by a few batched device ops on the
stream's own copy stream (never a device-wide synchronise). Host memory never takes this path (except when a test
forces it, to exercise the code on a machine without a GPU). `Bounces` is
the engine's set of them: the one place that decides when they are pinned
(and where #23's one bounded pool per engine, shared by every link, goes).
"""

from __future__ import annotations

import bisect
import itertools
import os
import socket
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from ..device_copy import copy_rows
from ..segments import balanced_parts, split_rows
from ..streams import CopyStream, cuda_device

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Below this a transfer goes whole on one stream: splitting costs more
# frames and wake-ups than a second stream saves.
STRIPE_MIN = 512 * 1024


def _ends(buffers: list[memoryview], sizes: list[int] | None) -> list[int]:
    return list(itertools.accumulate(sizes if sizes is not None else [b.nbytes for b in buffers]))


def send_all(sock: socket.socket, buffers: list[memoryview], sizes: list[int] | None = None) -> None:
    """Send every buffer, in order, with as few `sendmsg` calls as the kernel allows.

    `sizes` (each buffer's byte count) may be passed when the caller already
    has them, sparing a pass over the buffers.
    """
    ends = _ends(buffers, sizes)
    total = ends[-1] if ends else 0
    pos = i = 0
    first = buffers[0] if buffers else None
    while pos < total:
        sent = sock.sendmsg([first, *buffers[i + 1:i + IOV_MAX]])
        pos += sent
        i = bisect.bisect_right(ends, pos)
        if i < len(buffers):
            start = ends[i - 1] if i else 0
            first = buffers[i][pos - start:]


def recv_all(sock: socket.socket, buffers: list[memoryview], sizes: list[int] | None = None) -> int:
    """Fill every buffer, in order, with as few `recvmsg_into` calls as the kernel allows.

    Returns the bytes received; raises `ConnectionError` at EOF (callers
    translate it), since a stream never ends mid-payload on purpose.
    """
    ends = _ends(buffers, sizes)
    total = ends[-1] if ends else 0
    pos = i = 0
    first = buffers[0] if buffers else None
    while pos < total:
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


class Bounce:
    """A fixed host buffer that device bytes pass through on their way to or from a socket.

    Allocated by `allocate()`, which the engine calls when the stream is
    made (connect, accept) if it already holds CUDA memory, and for every
    stream when its first CUDA region is registered — so pinning (a
    `cudaHostAlloc` of several MiB, milliseconds) never happens inside a
    receiver's landing lock or on a transfer's path. Copies in and out are
    `device_copy` batches on this stream's own copy stream.
    """

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self._pinned = pinned
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.copies = CopyStream()

    @property
    def allocated(self) -> bool:
        """Whether the buffer exists (tests check it is made before any transfer)."""
        return self._buf is not None

    def allocate(self) -> None:
        """Make the buffer now (idempotent, thread-safe)."""
        with self._lock:
            if self._buf is None:
                self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def _buffer(self) -> torch.Tensor:
        if self._buf is None:
            # Only if a stream raced the registration that allocates it: the
            # engine allocates before any region a transfer can name exists.
            self.allocate()
        assert self._buf is not None
        return self._buf

    def plan(self, rows: np.ndarray, max_rows: int) -> Iterator[np.ndarray]:
        """`rows` cut into batches that fit the buffer."""
        return batches(split_rows(rows, self.nbytes), max_rows, self.nbytes)

    def gather(self, src: torch.Tensor, rows: np.ndarray, column: int, ready: object = None) -> memoryview:
        """Copy rows of `src` (offsets in `column`) into the buffer, after `ready`; its filled part."""
        buf = self._buffer()
        table, pos = _packed(rows, column, to_buffer=True)
        self.copies.run(cuda_device(src), ready, lambda: copy_rows(src, buf, table))
        return memoryview(buf.numpy())[:pos]

    def space(self, nbytes: int) -> memoryview:
        """The first `nbytes` of the buffer, to receive into."""
        return memoryview(self._buffer().numpy())[:nbytes]

    def scatter(self, dst: torch.Tensor, rows: np.ndarray, column: int) -> None:
        """Copy the buffer's leading bytes out to rows of `dst` (offsets in `column`); returns once landed."""
        buf = self._buffer()
        table, _ = _packed(rows, column, to_buffer=False)
        self.copies.run(cuda_device(dst), None, lambda: copy_rows(buf, dst, table))


class Bounces:
    """One engine's bounce buffers: pinned when the engine first holds CUDA memory, never before.

    `new()` is called when a stream is made (connect, accept): the buffer is
    allocated at once if the engine already holds CUDA memory (or
    `force_bounce`), else on `cuda_registered()`, which allocates every
    buffer made so far — never inside a transfer or a landing. Host-only
    engines never pin a byte.
    """

    def __init__(self, nbytes: int, *, force: bool) -> None:
        self.nbytes = nbytes
        self.force = force  # host memory takes the bounce path too (tests without a GPU)
        self._pinned = torch.cuda.is_available()
        self._lock = threading.Lock()
        self._all: weakref.WeakSet[Bounce] = weakref.WeakSet()
        self._active = force

    def new(self) -> Bounce:
        bounce = Bounce(self.nbytes, self._pinned)
        with self._lock:
            self._all.add(bounce)
            now = self._active
        if now:
            bounce.allocate()
        return bounce

    def cuda_registered(self) -> None:
        """The engine registered CUDA memory: allocate every buffer now (idempotent)."""
        with self._lock:
            first, self._active = not self._active, True
            pending = list(self._all) if first else []
        for bounce in pending:
            bounce.allocate()


def _packed(rows: np.ndarray, column: int, *, to_buffer: bool) -> tuple[np.ndarray, int]:
    # The copy table between a tensor's rows and the buffer packed from 0, and its bytes.
    n = rows[:, -1].astype(np.int64)
    packed = np.cumsum(n) - n
    offsets = rows[:, column].astype(np.int64)
    cols = (offsets, packed) if to_buffer else (packed, offsets)
    return np.stack([*cols, n], 1), int(n.sum())
