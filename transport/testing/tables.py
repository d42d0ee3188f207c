"""The kit's tables: random segment tables, canary fills and the checks that go with them.

Every conformance case that moves bytes checks them the same way: the
destination starts as `CANARY`, and `assert_landed` proves every row's bytes
arrived (checksums) and every other byte is still canary.
"""

from __future__ import annotations

import zlib

import numpy as np

CANARY = 0xA5


def random_table(
    rng: np.random.Generator, src_len: int, dst_len: int, rows: int, max_row: int
) -> np.ndarray:
    """`rows` disjoint destination ranges in shuffled order, gaps between them, random sources.

    The gaps leave canary bytes between destinations so a write that spills
    one byte past its range is caught.
    """
    lengths = rng.integers(1, max_row + 1, rows)
    gaps = rng.integers(1, 64, rows)
    if int((lengths + gaps).sum()) > dst_len or int(lengths.max()) > src_len:
        raise ValueError("table does not fit the regions; lower rows or max_row")
    dst = np.cumsum(lengths + gaps) - lengths
    src = rng.integers(0, src_len - lengths + 1)
    table = np.stack([src, dst, lengths], axis=1).astype(np.int64)
    return np.ascontiguousarray(table[rng.permutation(rows)])


def covered(table: np.ndarray, length: int) -> np.ndarray:
    """Boolean mask of the destination bytes `table` writes (vectorised)."""
    edges = np.zeros(length + 1, dtype=np.int64)
    np.add.at(edges, table[:, 1], 1)
    np.add.at(edges, table[:, 1] + table[:, 2], -1)
    return np.cumsum(edges[:-1]) > 0


def checksum(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
    """crc32 over the ranges of `buf`, in row order."""
    crc = 0
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        crc = zlib.crc32(buf[s:s + n], crc)
    return crc


def assert_landed(src: np.ndarray, dst: np.ndarray, table: np.ndarray) -> None:
    """Every row's bytes arrived (checksums agree) and every other byte is still canary."""
    sent = checksum(src, table[:, 0], table[:, 2])
    got = checksum(dst, table[:, 1], table[:, 2])
    assert got == sent, f"checksum mismatch: sent {sent:#x}, landed {got:#x}"
    outside = ~covered(table, dst.size)
    spoiled = np.flatnonzero(dst[outside] != CANARY)
    assert spoiled.size == 0, f"{spoiled.size} canary byte(s) outside the table were overwritten"
