"""`check_table` above its small-table path (32 rows), against a plain-Python oracle.

Issue #9 items 7/8: the vectorised acceptance (`_accept`: min/max bounds and
the sorted starts-versus-ends overlap test) runs only for tables over 32
rows. Here tables of 33..400 rows, disjoint or with one planted overlap (or a
row pushed past the end), are checked against a pairwise Python oracle: the
check accepts exactly the tables the oracle accepts, and says why it refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdxfer.transport.errors import BoundsError
from pdxfer.transport.segments import check_table

LENGTH = 1 << 20


def oracle(rows: list[list[int]], src_len: int, dst_len: int) -> str | None:
    """Why the table must be refused ("bounds" / "overlap"), or None; one row at a time."""
    for s, d, n in rows:
        if s < 0 or d < 0 or n <= 0 or s + n > src_len or d + n > dst_len:
            return "bounds"
    for i, (_, d1, n1) in enumerate(rows):
        for _, d2, n2 in rows[i + 1:]:
            if d1 < d2 + n2 and d2 < d1 + n1:
                return "overlap"
    return None


@st.composite
def tables(draw: st.DrawFn) -> np.ndarray:
    rows = draw(st.integers(33, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    slot = LENGTH // rows
    n = rng.integers(1, slot + 1, rows)
    dst = rng.permutation(rows) * slot + rng.integers(0, slot - n + 1)
    src = rng.integers(0, LENGTH - n + 1)
    table = np.stack([src, dst, n], 1).astype(np.int64)
    fault = draw(st.sampled_from(["none", "none", "overlap", "touching", "past-end"]))
    i, j = rng.choice(rows, 2, replace=False)
    if fault == "overlap":  # row j starts inside row i's destination
        table[j, 1] = table[i, 1] + int(rng.integers(0, table[i, 2]))
        table[j, 1] = min(table[j, 1], LENGTH - table[j, 2])
    elif fault == "touching":  # adjacent, not overlapping: must still be accepted
        table[j, 1] = table[i, 1] + table[i, 2]
        table[j, 2] = min(table[j, 2], LENGTH - table[j, 1]) or 1
    elif fault == "past-end":
        table[j, 1] = LENGTH - table[j, 2] + 1
    return table


@settings(max_examples=80, deadline=None)
@given(tables())
def test_large_tables_are_accepted_exactly_when_the_oracle_accepts(table: np.ndarray) -> None:
    why = oracle(table.tolist(), LENGTH, LENGTH)
    if why is None:
        assert check_table(table, LENGTH, LENGTH) == int(table[:, 2].sum())
    else:
        match = "overlap" if why == "overlap" else "past the destination region's end|outside"
        with pytest.raises(BoundsError, match=match):
            check_table(table, LENGTH, LENGTH)


def test_a_planted_overlap_in_a_large_table_is_named() -> None:
    rows = 100
    table = np.stack([np.arange(rows) * 64, np.arange(rows) * 64, np.full(rows, 64)], 1).astype(np.int64)
    table[70, 1] = table[20, 1] + 32
    with pytest.raises(BoundsError, match=r"destination rows 20 \[1280, 1344\) and 70 \[1312, 1376\) overlap"):
        check_table(table, LENGTH, LENGTH)
