"""`CheckedTable`: a planner's proof lets `check_table` skip the rows, and nothing else does.

Issue #13: the engine's route proves a table in bounds once (entry indices
checked, the peer's region bound checked at the handshake), so the write does
not re-read every row. These tests pin the edges of that trust: the proof
holds only for the exact lengths it was made for, a view or slice carries no
proof, the rows cannot be edited after the proof, and a backend write with a
proof that does not fit the regions is refused with the usual message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer.transport.errors import BoundsError
from pdxfer.transport.segments import CheckedTable, as_table, check_table

from pdxfer import transport

# Row 1 runs past a 4096 B destination: only a full check sees it.
BAD = np.array([[0, 0, 1024], [1024, 3584, 1024]], dtype=np.int64)


def test_a_proof_for_these_lengths_is_taken_without_reading_rows() -> None:
    table = CheckedTable.proven(BAD.copy(), 2048, 8192, 4096)
    assert as_table(table) is table
    # The proof says 2048 bytes for these exact lengths: the rows are not re-read.
    assert check_table(table, 8192, 4096) == 2048


@pytest.mark.parametrize("lengths", [(8192, 8192), (4096, 4096), (8192, 4095)])
def test_a_proof_for_other_lengths_gets_the_full_check(lengths: tuple[int, int]) -> None:
    table = CheckedTable.proven(BAD.copy(), 2048, *lengths)
    with pytest.raises(BoundsError, match=r"segment row 1 reads/writes destination bytes \[3584, 4608\)"):
        check_table(table, 8192, 4096)


def test_views_and_slices_carry_no_proof() -> None:
    table = CheckedTable.proven(BAD.copy(), 2048, 8192, 4096)
    for view in (table[1:], table.view(CheckedTable), table[:, :]):
        with pytest.raises(BoundsError, match="past the destination region's end"):
            check_table(as_table(view), 8192, 4096)


def test_a_proven_table_cannot_be_edited() -> None:
    table = CheckedTable.proven(np.array([[0, 0, 16]], dtype=np.int64), 16, 64, 64)
    with pytest.raises(ValueError, match="read-only"):
        table[0, 1] = 60


def test_a_loopback_write_with_a_proof_that_does_not_fit_is_refused() -> None:
    a, b = transport.create("loopback"), transport.create("loopback")
    try:
        src = a.register(torch.zeros(8192, dtype=torch.uint8))
        dst_buf = torch.zeros(4096, dtype=torch.uint8)
        remote = b.register(dst_buf).descriptor()
        conn = a.connect(b.address())
        lying = CheckedTable.proven(BAD.copy(), 2048, 8192, 8192)  # proved for a bigger peer
        with pytest.raises(BoundsError, match="past the destination region's end"):
            conn.write(src, remote, lying)
        assert not dst_buf.any()
    finally:
        a.close()
        b.close()
