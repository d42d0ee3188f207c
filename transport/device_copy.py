"""Copying a checked segment table between two torch byte tensors in a few batched ops.

Exists because the obvious way — one `copy_` per row — costs one kernel
launch (or one `cudaMemcpyAsync`) per row: 65,536 rows of 4 KiB are 65,536
launches, a few tenths of a second of pure overhead before a byte moves.
Here a table becomes *one or a few* ops whatever its row count, planned by
array arithmetic on the CPU (`plan_copy`, no Python per row) and run by
`run_copy`, which is the same code on CPU and CUDA tensors — so the suite
proves it byte for byte on CPU, canaries included, and a GPU runs exactly it.

How: rows adjacent on both sides merge first (`copying.coalesce`). A
handful of rows left are copied as slices (a few `copy_`s beat building an
index). Otherwise the table is cut into *cells* of `g` bytes, `g` the
largest power-of-two granule that divides every offset and length (4 KiB
pages give `g = 4096`, one cell per row), and each side is viewed as a
`[bytes // g, g]` grid: a row is then a run of whole cells, and the table
one index of cell numbers per side, built with `np.repeat` + `arange`.
One `index_select` gathers the source cells and one `index_copy_` scatters
them: when one side's cells are back to back (the bounce buffer, a
contiguous destination), that side is a plain slice and the bytes move
once (`index_select(out=)` or `index_copy_` from the slice); otherwise
through a temporary. Index size is bounded too (`MAX_CELLS` per op), so a
misaligned table (small `g`) becomes a few ops rather than an index larger
than its data.

Device temporaries are bounded per engine, not per copy (#23). A GPU pool
may fill 90 % of the device, and every copy thread allocating its own
temporaries (on its own stream, whose freed blocks torch's caching allocator
keeps for that stream) grows with the links that copy at once. So an engine
owns one `Scratch` per device (`Scratches`, `DEFAULT_SCRATCH_BYTES`,
allocated on its first use) holding every device temporary an op needs —
the uploaded cell indices and, where neither side is a run, the gathered
values — and `plan_copy` cuts a table into ops that fit it (a copy that
needs more is split). One copy at a time uses an engine's scratch on a
device (`Scratches.lease`, a bounded wait, held until the copy's stream has
finished with it). Host-only copies need no scratch. The budget is the
whole of an engine's device temporaries whatever the number of peers;
`tests/transport/test_device_copy.py` runs the scratch path on CPU tensors,
byte for byte.

Nothing outside a row is written: each cell index lists exactly the cells
of the table's rows, and the caller (`segments.check_table`) has already
proved the rows in bounds and the destinations disjoint — which is also
what makes `index_copy_` deterministic here.

Streams are the caller's business (`transport.streams`): `run_copy` only
enqueues on the current stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .copying import coalesce
from .errors import TransferTimeout

# At most this many rows after merging are copied as slices: a launch each,
# cheaper than planning and uploading an index for so few.
FEW_ROWS = 8
# Largest cell: bigger granules add nothing (a 4 MiB row as one cell is
# already one index entry) and keep the grid's row count meaningful.
MAX_CELL = 1 << 20
# Per op: index entries (8 B each, uploaded to the device).
MAX_CELLS = 1 << 20
# One engine's device temporaries per device (indices and gathered values of
# every op). Must hold the worst op of one cell of MAX_CELL bytes.
DEFAULT_SCRATCH_BYTES = 64 << 20
MIN_SCRATCH_BYTES = 4 * (MAX_CELL + 16)
# Temporaries of one cell: its values (g bytes) and one int64 index entry per side.
_INDEX_BYTES = 16


@dataclass(frozen=True)
class Batch:
    """One batched op: copy cells `src_cells` of the source grid to `dst_cells` of the destination.

    A side whose cells are consecutive is given as `(first, count)` in
    `src_run`/`dst_run` instead (its index is then not built at all).
    """

    cell: int
    src_cells: np.ndarray | None
    dst_cells: np.ndarray | None
    src_run: tuple[int, int] | None
    dst_run: tuple[int, int] | None

    @property
    def cells(self) -> int:
        """Cells this op moves."""
        return self.src_run[1] if self.src_run is not None else int(self.src_cells.shape[0])

    @property
    def temp_bytes(self) -> int:
        """The most temporary memory this op can need on one device: its indices and values."""
        if self.src_run is not None and self.dst_run is not None:
            return 0  # one plain copy, across devices too
        return self.cells * (self.cell + _INDEX_BYTES)


@dataclass(frozen=True)
class CopyPlan:
    """How `run_copy` moves a table: slice rows, then batched ops."""

    slices: np.ndarray  # [k, 3] rows copied one `copy_` each
    batches: tuple[Batch, ...]

    @property
    def ops(self) -> int:
        """Kernel launches (ignoring index uploads): what this module exists to keep small."""
        return int(self.slices.shape[0]) + len(self.batches)


def _granule(rows: np.ndarray) -> int:
    # The largest power of two (<= MAX_CELL) dividing every offset and length:
    # the lowest set bit of their OR.
    bits = int(np.bitwise_or.reduce(rows.reshape(-1))) | MAX_CELL
    return bits & -bits


def _cells(offsets: np.ndarray, counts: np.ndarray, g: int) -> np.ndarray:
    # Cell numbers of every row, in order: row i contributes offsets[i]//g + 0..counts[i]-1.
    total = int(counts.sum())
    firsts = np.repeat(offsets // g - (np.cumsum(counts) - counts), counts)
    return firsts + np.arange(total, dtype=np.int64)


def _run(offsets: np.ndarray, counts: np.ndarray, g: int) -> tuple[int, int] | None:
    # (first cell, count) when the rows are back to back on this side, else None.
    if offsets.shape[0] > 1 and not (offsets[1:] == offsets[:-1] + counts[:-1] * g).all():
        return None
    return int(offsets[0]) // g, int(counts.sum())


def plan_copy(table: np.ndarray, temp_bytes: int = DEFAULT_SCRATCH_BYTES) -> CopyPlan:
    """The batched ops that copy a checked `[n, 3]` table `(src, dst, nbytes)`.

    Pure array arithmetic on the CPU; the Python work is per op, never per
    row. Exists apart from `run_copy` so the planning is tested (and
    counted) without a device. Every op's temporaries (`Batch.temp_bytes`)
    fit in `temp_bytes`: a table that needs more is cut into more ops.
    """
    rows = coalesce(np.asarray(table, dtype=np.int64).reshape(-1, 3))
    rows = rows[rows[:, 2] > 0]
    if rows.shape[0] <= FEW_ROWS:
        return CopyPlan(rows, ())
    g = _granule(rows)
    counts = rows[:, 2] // g
    # A group may end one row past its share (below): two shares fit the budget.
    per_op = max(1, min(MAX_CELLS, temp_bytes // (2 * (g + _INDEX_BYTES))))
    # Cut the rows into consecutive groups of at most `per_op` cells (a row
    # longer than that is a group alone: its cells are consecutive anyway).
    cum = np.cumsum(counts)
    group = (cum - counts) // per_op
    big = np.flatnonzero(counts > per_op)  # alone in its group: its index stays its own size
    bounds = np.union1d(np.flatnonzero(np.diff(group)) + 1, np.concatenate((big, big + 1)))
    bounds = bounds[(bounds > 0) & (bounds < rows.shape[0])]
    batches = []
    for part in np.split(np.arange(rows.shape[0]), bounds):
        r, c = rows[part], counts[part]
        src_run, dst_run = _run(r[:, 0], c, g), _run(r[:, 1], c, g)
        batches.append(Batch(
            g,
            None if src_run else _cells(r[:, 0], c, g),
            None if dst_run else _cells(r[:, 1], c, g),
            src_run, dst_run,
        ))
    return CopyPlan(rows[:0], tuple(batches))


def _grid(t: torch.Tensor, g: int, word: torch.dtype) -> torch.Tensor:
    return t[: t.numel() // g * g].view(-1, g).view(word)


def _word(src: torch.Tensor, dst: torch.Tensor, g: int) -> torch.dtype:
    # The widest element both sides can be viewed as: index kernels move one
    # element per thread (CUDA) or per inner step (CPU), so 8-byte words move
    # a cell up to 8x faster than bytes. Needs g and both tensors' starts aligned.
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if g % size == 0 and all(t.storage_offset() % size == 0 and t.data_ptr() % size == 0
                                 for t in (src, dst)):
            return word
    return torch.uint8


def run_copy(src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan, scratch: Scratch | None = None) -> None:
    """Enqueue `plan`'s ops copying flat uint8 `src` into flat uint8 `dst` (any devices).

    On CUDA the ops go on the current stream and return at once; the
    caller synchronises (see `transport.streams`). On CPU they run now.
    With `scratch`, every temporary on the scratch's device (indices,
    gathered values) is carved from it instead of allocated; the caller
    holds its lease until the stream is done (`Scratches.lease`).
    """
    for s, d, n in plan.slices.tolist():
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    for b in plan.batches:
        word = _word(src, dst, b.cell)
        sgrid, dgrid = _grid(src, b.cell, word), _grid(dst, b.cell, word)
        temps = _Temps(scratch, b, word)
        if b.src_run is not None:
            a, k = b.src_run
            values = sgrid[a:a + k]
        elif b.dst_run is not None and src.device == dst.device:
            c, k = b.dst_run  # gather straight into place: the bytes move once
            torch.index_select(sgrid, 0, temps.index(b.src_cells, src.device), out=dgrid[c:c + k])
            continue
        else:
            index = temps.index(b.src_cells, src.device)
            values = torch.index_select(sgrid, 0, index, out=temps.values(src.device, sgrid))
        if b.dst_run is not None:
            c, k = b.dst_run  # stream-ordered, also across devices
            dgrid[c:c + k].copy_(values, non_blocking=True)
            continue
        if values.device != dst.device:
            # Host->device may be asynchronous (ordered on the stream before
            # the scatter); device->host must have landed before the CPU
            # scatter reads it, so it blocks (on this stream only).
            moved = temps.values(dst.device, dgrid)
            if moved is None:
                values = values.to(dst.device, non_blocking=dst.device.type == "cuda")
            else:
                values = moved.copy_(values, non_blocking=dst.device.type == "cuda")
        dgrid.index_copy_(0, temps.index(b.dst_cells, dst.device), values)


class _Temps:
    """One op's temporaries: from the scratch on its device, else allocated as before.

    Layout in the scratch: the values (cells x cell bytes) first, then one
    int64 index per side — `Batch.temp_bytes` plus at most 7 B of alignment,
    which `plan_copy` kept within the scratch (a group stays at least one
    cell's temporaries under the budget).
    """

    def __init__(self, scratch: Scratch | None, batch: Batch, word: torch.dtype) -> None:
        self.scratch, self.batch, self.word = scratch, batch, word
        self.next_index = -(-batch.cells * batch.cell // 8) * 8  # after the values, 8-aligned

    def _mine(self, device: torch.device) -> bool:
        return self.scratch is not None and self.scratch.device == device

    def index(self, cells: np.ndarray | None, device: torch.device) -> torch.Tensor:
        assert cells is not None  # plan_copy builds an index for every side that is not a run
        if not self._mine(device):
            return torch.from_numpy(cells).to(device, non_blocking=True)
        n = cells.shape[0]
        at, self.next_index = self.next_index, self.next_index + 8 * n
        out = self.scratch.buf[at:at + 8 * n].view(torch.int64)
        return out.copy_(torch.from_numpy(cells))

    def values(self, device: torch.device, like: torch.Tensor) -> torch.Tensor | None:
        """Room for the op's gathered values on `device`, shaped as rows of `like` (None: allocate)."""
        if not self._mine(device):
            return None
        b = self.batch
        return self.scratch.buf[:b.cells * b.cell].view(self.word).view(b.cells, like.shape[1])


def copy_rows(src: torch.Tensor, dst: torch.Tensor, table: np.ndarray,
              scratch: Scratch | None = None) -> None:
    """`run_copy(src, dst, plan_copy(table, ...), scratch)`: the one call the backends make."""
    budget = scratch.nbytes if scratch is not None else DEFAULT_SCRATCH_BYTES
    run_copy(src, dst, plan_copy(table, budget), scratch)


Allocate = Callable[[int, torch.device], torch.Tensor]


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Scratch:
    """One device's temporaries for one engine: a fixed buffer, used by one copy at a time."""

    def __init__(self, device: torch.device, nbytes: int, allocate: Allocate) -> None:
        self.device = device
        self.nbytes = nbytes
        self.buf = allocate(nbytes, device)
        self.lock = threading.Lock()


class Scratches:
    """One engine's device scratches, one per device, each `nbytes` (made on first use).

    `allocate(nbytes, device)` is a seam for tests; `allocated_bytes` is the
    whole of this engine's device temporaries.
    """

    def __init__(self, nbytes: int = DEFAULT_SCRATCH_BYTES, allocate: Allocate | None = None) -> None:
        if nbytes < MIN_SCRATCH_BYTES:
            raise ValueError(f"a device scratch of {nbytes} B cannot hold one op's worst cell; "
                             f"give it at least {MIN_SCRATCH_BYTES} B")
        self.nbytes = nbytes
        self._allocate = allocate or _allocate
        self._lock = threading.Lock()
        self._by_device: dict[torch.device, Scratch] = {}

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every scratch made so far (one per device used)."""
        with self._lock:
            return len(self._by_device) * self.nbytes

    def get(self, device: torch.device) -> Scratch:
        """`device`'s scratch, allocated on first use."""
        with self._lock:
            found = self._by_device.get(device)
            if found is None:
                found = self._by_device[device] = Scratch(device, self.nbytes, self._allocate)
            return found

    @contextmanager
    def lease(self, device: torch.device, timeout: float, *,
              host: bool = False) -> Iterator[Scratch | None]:
        """The scratch of `device` for one copy; hold it until the copy's stream is done.

        Host copies need none (`None`), unless `host=True` (tests run the
        scratch path on CPU tensors). Another copy of this engine on the same
        device is waited for at most `timeout` s (local device work), then
        `TransferTimeout`.
        """
        if device.type != "cuda" and not host:
            yield None
            return
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        scratch = self.get(device)
        if not scratch.lock.acquire(timeout=timeout):
            raise TransferTimeout(
                f"the engine's device scratch on {device} was not free within {timeout} s; "
                "another copy of this engine holds it (a stalled device?)")
        try:
            yield scratch
        finally:
            scratch.lock.release()
