"""Loopback's copy planner (`transport.copying`): every path moves exactly the named bytes.

The conformance suite drives whole transfers; these tests aim at each branch
of the planner — merged runs, the three vectorised window copies, mixed
lengths, helper threads — with canaries around every row, on buffers small
enough to stay fast (thresholds are shrunk with monkeypatch to force the
threaded path).
"""

from __future__ import annotations

import numpy as np
import pytest
from pdxfer.transport import copying
from pdxfer.transport.copying import CopyPool, coalesce, plan
from pdxfer.transport.testing.tables import CANARY, assert_landed, random_table

N = 1 << 20


def _buffers(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8)
    return src, np.full(N, CANARY, dtype=np.uint8)


def _equal_table(rng: np.random.Generator, rows: int, n: int, src: str, dst: str) -> np.ndarray:
    # Row placements, one per branch of _equal_rows: "seq" back to back from
    # an odd offset, "even" every other slot, "grid" random slots on a grid
    # of n, "random" random slots with a 7-byte gap after each (so canaries
    # sit between destination rows), from an odd offset.
    def side(how: str, start: int) -> np.ndarray:
        if how == "seq":
            return np.arange(rows) * n + start
        if how == "even":
            return np.arange(rows) * 2 * n + start
        if how == "grid":
            return rng.choice(N // n - 1, rows, replace=False) * n
        return rng.choice(N // (n + 7) - 1, rows, replace=False) * (n + 7) + start

    return np.stack([side(src, 5), side(dst, 3), np.full(rows, n)], 1).astype(np.int64)


def _functions(table: np.ndarray) -> set[str]:
    return {fn.__name__ for _, fn, _ in plan(table)}


@pytest.mark.parametrize("src,dst", [("seq", "random"), ("even", "seq"), ("grid", "seq"),
                                     ("grid", "random"), ("random", "seq"), ("random", "random")])
def test_equal_rows_are_vectorised_and_exact(src: str, dst: str) -> None:
    # Together the cases take every branch of _equal_rows: strided-view
    # scatter, np.take into a block, gather into a block or a scatter.
    table = _equal_table(np.random.default_rng(1), 200, 1000, src, dst)
    src_buf, dst_buf = _buffers()
    assert _functions(table) == {"_equal_rows"}
    CopyPool(1).copy(src_buf, dst_buf, table)
    assert_landed(src_buf, dst_buf, table)


def test_rows_adjacent_on_both_sides_merge_and_nothing_else_does() -> None:
    table = np.array([[0, 100, 10], [10, 110, 5], [15, 115, 1],  # one run of 16 bytes
                      [16, 200, 4],  # source adjacent, destination not: stays
                      [40, 204, 4]], dtype=np.int64)  # destination adjacent, source not: stays
    merged = coalesce(table)
    assert merged.tolist() == [[0, 100, 16], [16, 200, 4], [40, 204, 4]]
    assert table[0, 2] == 10  # the caller's table is not modified
    src, dst = _buffers()
    CopyPool(1).copy(src, dst, table)
    assert_landed(src, dst, table)


def test_contiguous_table_becomes_one_copy() -> None:
    table = np.stack([np.arange(256) * 4096, np.arange(256) * 4096, np.full(256, 4096)], 1)
    jobs = plan(table.astype(np.int64))
    assert [(b, rows.tolist()) for b, _, rows in jobs] == [(N, [[0, 0, N]])]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows,max_row", [(3000, 300), (40, 20000), (400, 4096)])
def test_random_mixed_tables_land_exactly(monkeypatch: pytest.MonkeyPatch, threads: int,
                                          rows: int, max_row: int) -> None:
    # Shrunk thresholds: small buffers take the batched, threaded path.
    monkeypatch.setattr(copying, "PARALLEL_MIN", 1)
    monkeypatch.setattr(copying, "BATCH", 8192)
    rng = np.random.default_rng(rows)
    table = random_table(rng, N, N, rows, max_row)
    # Some equal-length groups, so mixed tables also take the vectorised path.
    table[: rows // 2, 2] = np.minimum(table[: rows // 2, 2], 16)
    src, dst = _buffers(rows)
    pool = CopyPool(threads)
    try:
        pool.copy(src, dst, table)
    finally:
        pool.close()
    assert_landed(src, dst, table)


def test_failing_copy_raises_to_the_caller_and_close_is_idempotent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copying, "PARALLEL_MIN", 1)
    monkeypatch.setattr(copying, "BATCH", 4096)
    table = _equal_table(np.random.default_rng(2), 64, 4096, "seq", "random")
    src, dst = _buffers()
    pool = CopyPool(2)
    dst.flags.writeable = False  # every batch fails, on whichever thread claims it
    with pytest.raises(ValueError, match="read-only"):
        pool.copy(src, dst, table)
    pool.close()
    pool.close()  # idempotent
    dst.flags.writeable = True
    pool.copy(src, dst, table)  # after close: the caller's thread alone, still exact
    assert_landed(src, dst, table)


def test_coalesce_posted_merges_long_tables_and_leaves_request_sized_ones() -> None:
    # What the tcp and nixl posting paths send: 65,536 in-order 4 KiB rows become one row
    # (one iovec / one NIXL descriptor), the same bytes; a request-sized table is passed as is.
    n, seg = 65536, 4096
    rows = np.stack([np.arange(n) * seg, np.arange(n) * seg + 8192, np.full(n, seg)], 1).astype(np.int64)
    assert copying.coalesce_posted(rows).tolist() == [[0, 8192, n * seg]]
    small = rows[:16]
    assert copying.coalesce_posted(small) is small
    shuffled = rows.copy()
    slots = np.random.default_rng(0).permutation(n)
    shuffled[:, 1] = slots * seg
    out = copying.coalesce_posted(shuffled)
    joins = int(np.count_nonzero(slots[1:] == slots[:-1] + 1))  # neighbours adjacent by chance
    assert out.shape[0] == n - joins and out[:, 2].sum() == n * seg
