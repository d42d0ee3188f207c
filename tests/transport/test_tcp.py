"""What only tcp has: striping, vectored I/O loops, the bounce path, where it listens."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
from pdxfer.transport import TransportError
from pdxfer.transport.segments import split_rows
from pdxfer.transport.tcp.io import IOV_MAX, STRIPE_MIN, batches, plan_stripes, recv_all, send_all
from pdxfer.transport.testing.tables import CANARY, assert_landed, random_table

from pdxfer import transport


def test_listens_on_loopback_unless_told_otherwise() -> None:
    with transport.create("tcp") as eng:
        addr = eng.address()
        assert addr["host"] == "127.0.0.1" and addr["port"] > 0 and addr["backend"] == "tcp"
        assert eng.listener.host == "127.0.0.1"
        assert 2 <= eng.streams <= 8


@pytest.mark.parametrize("streams", [0, 65, 2.0, True])
def test_stream_count_is_validated(streams: object) -> None:
    with pytest.raises(TransportError, match="streams must be an int in 1..64"):
        transport.create("tcp", streams=streams)


def test_split_rows_cuts_long_rows_into_capped_pieces() -> None:
    table = np.array([[0, 100, 10], [50, 0, 25]], np.int64)
    assert split_rows(table, 10).tolist() == [[0, 100, 10], [50, 0, 10], [60, 10, 10], [70, 20, 5]]
    ranges = np.array([[7, 9]], np.int64)  # receiver's (dst_offset, nbytes) form
    assert split_rows(ranges, 4).tolist() == [[7, 4], [11, 4], [15, 1]]


def _bytes_of(parts: list[np.ndarray]) -> list[int]:
    return [int(p[:, 2].sum()) for p in parts]


def test_one_huge_segment_is_striped_evenly_over_every_stream() -> None:
    table = np.array([[0, 0, 10_000_001]], np.int64)
    parts = plan_stripes(table, 3)
    assert len(parts) == 3 and sum(_bytes_of(parts)) == 10_000_001
    assert max(_bytes_of(parts)) - min(_bytes_of(parts)) <= 2
    joined = np.concatenate(parts)
    assert (joined[1:, 0] == joined[:-1, 0] + joined[:-1, 2]).all()  # covers the row in order


def test_many_rows_are_striped_by_balanced_bytes() -> None:
    table = random_table(np.random.default_rng(1), 1 << 22, 1 << 24, 400, 40_000)
    parts = plan_stripes(table, 4)
    sizes = _bytes_of(parts)
    assert len(parts) == 4 and sum(sizes) == int(table[:, 2].sum())
    assert max(sizes) - min(sizes) <= 2 * 40_000


def test_small_and_empty_transfers_stay_on_one_stream() -> None:
    small = np.array([[0, 0, 2 * STRIPE_MIN - 1]], np.int64)
    assert len(plan_stripes(small, 8)) == 1
    assert plan_stripes(np.zeros((0, 3), np.int64), 8)[0].shape == (0, 3)


def test_batches_respect_row_and_byte_caps() -> None:
    rows = np.array([[0, 0, 6]] * 10, np.int64)
    assert [b.shape[0] for b in batches(rows, 4)] == [4, 4, 2]
    assert [int(b[:, 2].sum()) for b in batches(rows, 100, 20)] == [18, 18, 18, 6]


def test_vectored_loops_move_more_buffers_than_iov_max_across_partial_calls() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force many partial sendmsg calls
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 300, 3 * IOV_MAX)
    src = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    dst = np.zeros_like(src)
    ends = np.cumsum(sizes)
    cut = lambda buf: [memoryview(buf)[e - n:e] for e, n in zip(ends, sizes, strict=True)]  # noqa: E731
    sender = threading.Thread(target=send_all, args=(a, cut(src)))
    sender.start()
    assert recv_all(b, cut(dst)) == src.size
    sender.join(10)
    a.close()
    b.close()
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("streams", [1, 3])
def test_bounce_path_round_trip_without_a_gpu(streams: int) -> None:
    """`force_bounce` sends host memory the way CUDA memory goes: staged in a small buffer."""
    opts = {"streams": streams, "force_bounce": True, "bounce_bytes": 64 << 10}
    with transport.create("tcp", **opts) as tx, transport.create("tcp", **opts) as rx:
        rng = np.random.default_rng(streams)
        src = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
        dst = np.full(4 << 20, CANARY, dtype=np.uint8)
        s, d = tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))
        table = random_table(rng, src.size, dst.size, 40, 200_000)  # rows up to 3x the bounce
        tx.connect(rx.address()).write(s, d.descriptor(), table).wait(20)
        assert_landed(src, dst, table)


def test_striped_transfer_of_one_large_segment_lands_exactly() -> None:
    with transport.create("tcp", streams=3) as tx, transport.create("tcp", streams=3) as rx:
        src = np.random.default_rng(2).integers(0, 256, 6 << 20, dtype=np.uint8)
        dst = np.full(8 << 20, CANARY, dtype=np.uint8)
        s, d = tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))
        table = np.array([[1, 333, (6 << 20) - 1]], np.int64)
        got: list[bytes] = []
        rx.set_notify_handler(lambda sender, payload: got.append(payload))
        tx.connect(rx.address()).write(s, d.descriptor(), table, notify=b"n").wait(20)
        assert_landed(src, dst, table)
        assert got == [b"n"]
