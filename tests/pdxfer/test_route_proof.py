"""A route proves its tables in bounds only when the peer's region can hold what it declares.

Issue #13: `pools.Route` hands the transport `CheckedTable`s so a write does
not re-check rows the planner already bounded. The bound is checked once, at
the handshake, against the peer's region descriptor: a peer that declares
more entries than its region holds gets plain tables, and the transport's full
check refuses the row that would run past its region, as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer.transport.errors import BoundsError
from pdxfer.transport.segments import CheckedTable

from pdxfer import layout, transport
from pdxfer.pools import PoolSet, peer_routes

FIELDS = [layout.EntryField("k", 2, (4, 8), torch.float16)]


def _pair(entries: int = 16) -> tuple:
    a, b = transport.create("loopback"), transport.create("loopback")
    ours = PoolSet({"kv": layout.EntryMajorArena(FIELDS, entries, "cpu")}, a)
    theirs = PoolSet({"kv": layout.EntryMajorArena(FIELDS, entries, "cpu")}, b)
    return a, b, ours, theirs


def test_tables_of_an_honest_peer_carry_a_proof_with_their_bytes() -> None:
    a, b, ours, theirs = _pair()
    try:
        hello = theirs.hello_fields()
        route = peer_routes(ours, hello["pools"], hello["buffers"], hello["regions"])["kv"]
        (_, _, table), = route.plan(np.array([3, 4, 9]), np.array([0, 1, 15]), False)
        assert type(table) is CheckedTable
        stride = ours.arenas["kv"].slot_stride
        assert table.proof == (ours.regions[0].length, hello["regions"][0]["length"], 3 * stride)
        assert table.tolist() == [[3 * stride, 0, 2 * stride], [9 * stride, 15 * stride, stride]]
    finally:
        a.close()
        b.close()


def test_a_peer_declaring_more_entries_than_its_region_holds_gets_the_full_check() -> None:
    a, b, ours, theirs = _pair()
    try:
        hello = theirs.hello_fields()
        pools = {"kv": dict(hello["pools"]["kv"], entries=32)}  # its region holds 16
        route = peer_routes(ours, pools, hello["buffers"], hello["regions"])["kv"]
        assert route.proof is None
        (region, remote, table), = route.plan(np.array([1]), np.array([20]), False)
        assert type(table) is not CheckedTable
        conn = a.connect(b.address())
        with pytest.raises(BoundsError, match="past the destination region's end"):
            conn.write(region, remote, table)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_proof_counts_the_bytes_the_rows_move(checkpoint: bool) -> None:
    fields = [layout.EntryField("conv", 2, (3, 8), torch.float16),
              layout.EntryField("ssm", 2, (8, 8), torch.float32, in_checkpoint=False)]
    a, b = transport.create("loopback"), transport.create("loopback")
    try:
        ours = PoolSet({"s": layout.EntryMajorArena(fields, 64, "cpu")}, a)
        hello = PoolSet({"s": layout.EntryMajorArena(fields, 64, "cpu")}, b).hello_fields()
        route = peer_routes(ours, hello["pools"], hello["buffers"], hello["regions"])["s"]
        src, dst = np.array([9, 3, 4, 40, 41]), np.array([1, 2, 3, 60, 61])
        (_, _, table), = route.plan(src, dst, checkpoint)
        assert table.proof[2] == int(table[:, 2].sum()) > 0
    finally:
        a.close()
        b.close()
