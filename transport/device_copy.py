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
through a temporary bounded by `MAX_BATCH_BYTES`. Index size is bounded
too (`MAX_CELLS` per op), so a misaligned table (small `g`) becomes a few
ops rather than an index larger than its data.

Nothing outside a row is written: each cell index lists exactly the cells
of the table's rows, and the caller (`segments.check_table`) has already
proved the rows in bounds and the destinations disjoint — which is also
what makes `index_copy_` deterministic here.

Streams are the caller's business (`transport.streams`): `run_copy` only
enqueues on the current stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .copying import coalesce

# At most this many rows after merging are copied as slices: a launch each,
# cheaper than planning and uploading an index for so few.
FEW_ROWS = 8
# Largest cell: bigger granules add nothing (a 4 MiB row as one cell is
# already one index entry) and keep the grid's row count meaningful.
MAX_CELL = 1 << 20
# Per op: index entries (8 B each, uploaded to the device) and temporary bytes.
MAX_CELLS = 1 << 20
MAX_BATCH_BYTES = 256 << 20


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


def plan_copy(table: np.ndarray) -> CopyPlan:
    """The batched ops that copy a checked `[n, 3]` table `(src, dst, nbytes)`.

    Pure array arithmetic on the CPU; the Python work is per op, never per
    row. Exists apart from `run_copy` so the planning is tested (and
    counted) without a device.
    """
    rows = coalesce(np.asarray(table, dtype=np.int64).reshape(-1, 3))
    rows = rows[rows[:, 2] > 0]
    if rows.shape[0] <= FEW_ROWS:
        return CopyPlan(rows, ())
    g = _granule(rows)
    counts = rows[:, 2] // g
    per_op = max(1, min(MAX_CELLS, MAX_BATCH_BYTES // g))
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


def run_copy(src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan) -> None:
    """Enqueue `plan`'s ops copying flat uint8 `src` into flat uint8 `dst` (any devices).

    On CUDA the ops go on the current stream and return at once; the
    caller synchronises (see `transport.streams`). On CPU they run now.
    """
    for s, d, n in plan.slices.tolist():
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    for b in plan.batches:
        word = _word(src, dst, b.cell)
        sgrid, dgrid = _grid(src, b.cell, word), _grid(dst, b.cell, word)
        if b.src_run is not None:
            a, k = b.src_run
            values = sgrid[a:a + k]
        elif b.dst_run is not None and src.device == dst.device:
            c, k = b.dst_run  # gather straight into place: the bytes move once
            torch.index_select(sgrid, 0, _index(b.src_cells, src.device), out=dgrid[c:c + k])
            continue
        else:
            values = sgrid.index_select(0, _index(b.src_cells, src.device))
        if b.dst_run is not None:
            c, k = b.dst_run  # stream-ordered, also across devices
            dgrid[c:c + k].copy_(values, non_blocking=True)
            continue
        if values.device != dst.device:
            # Host->device may be asynchronous (ordered on the stream before
            # the scatter); device->host must have landed before the CPU
            # scatter reads it, so it blocks (on this stream only).
            values = values.to(dst.device, non_blocking=dst.device.type == "cuda")
        dgrid.index_copy_(0, _index(b.dst_cells, dst.device), values)


def _index(cells: np.ndarray | None, device: torch.device) -> torch.Tensor:
    assert cells is not None  # plan_copy builds an index for every side that is not a run
    return torch.from_numpy(cells).to(device, non_blocking=True)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, table: np.ndarray) -> None:
    """`run_copy(src, dst, plan_copy(table))`: the one call the backends make."""
    run_copy(src, dst, plan_copy(table))
