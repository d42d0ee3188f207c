"""The batched device-copy planner (`transport.device_copy`), run byte for byte on CPU tensors.

`run_copy` is the same code on CUDA tensors (loopback's device path, tcp's
bounce); here it runs on CPU torch tensors with canaries around every
destination row, and the plans are counted: a 65,536-row table must be a
handful of ops, never one per row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer.transport import device_copy
from pdxfer.transport.device_copy import copy_rows, plan_copy, run_copy
from pdxfer.transport.testing.tables import CANARY, assert_landed, random_table

N = 1 << 20


def _tensors(seed: int = 0, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
    return src, torch.full((n,), CANARY, dtype=torch.uint8)


def _check(table: np.ndarray, n: int = N) -> device_copy.CopyPlan:
    src, dst = _tensors(n=n)
    plan = plan_copy(table)
    run_copy(src, dst, plan)
    assert_landed(src.numpy(), dst.numpy(), table)
    return plan


def test_random_mixed_rows_land_exactly_in_few_ops() -> None:
    table = random_table(np.random.default_rng(3), N, N, 500, 1500)
    plan = _check(table)
    assert plan.ops <= 2, plan.ops  # 500 rows, one granule (1 B): one gather + scatter batch


def test_page_table_uses_one_cell_per_row() -> None:
    rng = np.random.default_rng(4)
    pages = N // 4096
    table = np.stack([rng.permutation(pages)[:200] * 4096, rng.permutation(pages)[:200] * 4096,
                      np.full(200, 4096)], 1).astype(np.int64)
    plan = _check(table)
    (batch,) = plan.batches
    assert batch.cell == 4096 and batch.src_cells.shape == (200,)


def test_65536_rows_are_a_few_ops() -> None:
    # The table: 65,536 rows of 4 KiB (here 64 B, the same row count
    # and arithmetic at a CPU-friendly size), destinations scattered.
    rows, n = 65536, 64
    rng = np.random.default_rng(5)
    table = np.stack([rng.permutation(rows) * n, rng.permutation(rows) * n,
                      np.full(rows, n)], 1).astype(np.int64)
    plan = _check(table, rows * n)
    assert plan.ops == 1 and plan.slices.shape[0] == 0


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_back_to_back_side_is_a_slice_not_an_index(side: str) -> None:
    # The bounce buffer's side: gather into (or scatter out of) one contiguous run.
    rng = np.random.default_rng(6)
    scattered = rng.permutation(N // 1000 - 1)[:300] * 1000 + 7
    run = np.arange(300) * 1000 + 3
    cols = (run, scattered) if side == "src" else (scattered, run)
    table = np.stack([*cols, np.full(300, 1000)], 1).astype(np.int64)
    plan = _check(table)
    (batch,) = plan.batches
    assert (batch.src_run is not None) == (side == "src")
    assert (batch.dst_run is not None) == (side == "dst")


def test_few_rows_are_slices_and_adjacent_rows_merge() -> None:
    table = np.array([[0, 500, 10], [10, 510, 20], [900, 40, 7]], dtype=np.int64)
    plan = _check(table)
    assert plan.batches == () and plan.slices.tolist() == [[0, 500, 30], [900, 40, 7]]


def test_batches_are_bounded_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_copy, "MAX_CELLS", 1000)
    table = random_table(np.random.default_rng(7), N, N, 400, 2000)
    plan = _check(table)
    assert len(plan.batches) > 100  # ~400 KB at 1 B cells, 1000 cells per op
    assert all(b.src_cells is None or b.src_cells.shape[0] <= 1000 + 2000 for b in plan.batches)


def test_one_huge_misaligned_row_builds_no_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_copy, "MAX_CELLS", 1000)
    big = [[1, 3, 300_001]] + [[400_000 + 10 * i, 400_003 + 10 * i, 9] for i in range(20)]
    plan = _check(np.array(big, dtype=np.int64))
    for b in plan.batches:
        for cells in (b.src_cells, b.dst_cells):
            assert cells is None or cells.shape[0] <= 1000 + 9


def test_empty_and_zero_length_rows_copy_nothing() -> None:
    src, dst = _tensors()
    copy_rows(src, dst, np.zeros((0, 3), dtype=np.int64))
    copy_rows(src, dst, np.array([[5, 9, 0]] * 20, dtype=np.int64))
    assert (dst.numpy() == CANARY).all()


# -- the engine's device scratch (#23): every temporary of an op in one bounded buffer --------


def _scratch(nbytes: int) -> device_copy.Scratch:
    made: list[int] = []
    scratches = device_copy.Scratches(nbytes, lambda n, dev: (made.append(n),
                                                              torch.empty(n, dtype=torch.uint8))[1])
    with scratches.lease(torch.device("cpu"), 1.0, host=True) as scratch:
        assert made == [nbytes] and scratches.allocated_bytes == nbytes
        return scratch


@pytest.mark.parametrize("shape", ["scattered both", "run source", "run destination", "misaligned"])
def test_copies_through_the_scratch_land_exactly_and_fit_it(shape: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 MiB of 4 KiB cells scattered on both sides needs 2 MiB of gathered values: a
    # 64 KiB scratch (cells capped at 4 KiB to allow one so small) cuts it into ops that fit.
    monkeypatch.setattr(device_copy, "MAX_CELL", 4096)
    monkeypatch.setattr(device_copy, "MIN_SCRATCH_BYTES", 4 * (4096 + 16))
    rng = np.random.default_rng(11)
    n, rows = 4 << 20, 512
    a, b = rng.permutation(n // 4096)[:rows] * 4096, rng.permutation(n // 4096)[:rows] * 4096
    run = np.arange(rows) * 4096
    src_col, dst_col = {"scattered both": (a, b), "run source": (run, b),
                        "run destination": (a, run), "misaligned": (a + 3, b + 5)}[shape]
    size = 4096 if shape != "misaligned" else 1000  # 1 B cells: a few rows per op
    table = np.stack([src_col, dst_col, np.full(rows, size)], 1).astype(np.int64)
    scratch = _scratch(64 << 10)
    scratch.buf.fill_(0xEE)
    plan = plan_copy(table, scratch.nbytes)
    assert all(op.temp_bytes + 8 <= scratch.nbytes for op in plan.batches)
    if shape == "scattered both":
        assert len(plan.batches) >= 32, "2 MiB of values cannot pass a 64 KiB scratch in fewer ops"
    src, dst = _tensors(n=n)
    run_copy(src, dst, plan, scratch)
    assert_landed(src.numpy(), dst.numpy(), table)
    assert (scratch.buf != 0xEE).any(), "the ops took their temporaries elsewhere"


def test_host_copies_lease_no_scratch_and_a_busy_scratch_is_waited_for_boundedly() -> None:
    scratches = device_copy.Scratches()
    with scratches.lease(torch.device("cpu"), 1.0) as scratch:
        assert scratch is None and scratches.allocated_bytes == 0  # host copies need none
    with scratches.lease(torch.device("cpu"), 1.0, host=True):
        with pytest.raises(device_copy.TransferTimeout, match="device scratch on cpu was not free"):
            with scratches.lease(torch.device("cpu"), 0.05, host=True):
                pass
    assert scratches.allocated_bytes == device_copy.DEFAULT_SCRATCH_BYTES == 64 << 20
