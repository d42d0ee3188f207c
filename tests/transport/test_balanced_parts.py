"""`balanced_parts` takes a plain-int path for small tables; it must cut exactly as the vectorised one.

Issue #13: tcp stripes every write with `balanced_parts`, and for a request's
17-row table a dozen numpy calls cost more than the rows, so tables of up to
`_TINY` rows with no row longer than a share are cut in plain ints. The oracle
here is the vectorised algorithm written out (split rows, cumulative sums,
`searchsorted`, `np.split`); both must return the same parts, row for row.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pdxfer.transport.segments import balanced_parts, split_rows


def oracle(table: np.ndarray, parts: int) -> list[np.ndarray]:
    total = int(table[:, -1].sum()) if table.shape[0] else 0
    if parts < 2 or total == 0:
        return [table]
    table = split_rows(table, -(-total // parts))
    cum = np.cumsum(table[:, -1])
    cuts = np.searchsorted(cum, total * np.arange(1, parts, dtype=np.int64) // parts, side="left") + 1
    return [p for p in np.split(table, cuts) if p.shape[0]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), max_size=40), st.integers(0, 8), st.integers(0, 2**32 - 1))
def test_small_tables_are_cut_as_the_vectorised_path_cuts_them(sizes: list[int], parts: int,
                                                               seed: int) -> None:
    rng = np.random.default_rng(seed)
    table = np.empty((len(sizes), 3), dtype=np.int64)
    table[:, 0] = rng.integers(0, 1 << 30, len(sizes))
    table[:, 1] = rng.integers(0, 1 << 30, len(sizes))
    table[:, 2] = sizes
    got, want = balanced_parts(table, parts), oracle(table, parts)
    assert [p.tolist() for p in got] == [p.tolist() for p in want]
    assert not table.shape[0] or all(p.shape[0] for p in got)  # an empty table stays whole


def test_a_request_table_is_split_in_two_balanced_runs() -> None:
    table = np.array([[i * 4096, i * 8192, 65536] for i in range(16)], dtype=np.int64)
    first, second = balanced_parts(table, 2)
    assert first.shape[0] == second.shape[0] == 8
    assert np.array_equal(np.concatenate([first, second]), table)
