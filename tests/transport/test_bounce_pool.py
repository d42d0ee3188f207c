"""tcp's bounce pool (#23): pinned memory bounded per engine, whatever the number of peers.

Runs on CPU through `force_bounce` (host memory takes the CUDA path's
bounce), so the pool's accounting — `allocated_bytes`, what its allocator
handed out — is what a GPU machine would pin. What only a GPU run shows is
that those bytes are page-locked (`pinned`), not how many there are.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from pdxfer.transport.errors import CapabilityError, PeerLostError, TransferTimeout
from pdxfer.transport.tcp.bounce import DEFAULT_POOL_BYTES, BouncePool
from pdxfer.transport.testing.rig import Gate
from pdxfer.transport.testing.tables import CANARY, assert_landed

from pdxfer import transport

SLOT = 64 << 10
PEERS = 64
WAIT = 30.0


def _tcp(**opts: object) -> transport.TransportEngine:
    return transport.create("tcp", streams=1, force_bounce=True, bounce_bytes=SLOT, **opts)


def test_64_peers_both_ways_stay_within_the_pool() -> None:
    """One engine linked to 64 peers, every link busy both ways at once: pool bytes <= its budget."""
    budget = 8 * SLOT  # 4 sending + 4 landing slots, against 64 streams each way
    hub = _tcp(bounce_pool_bytes=budget)
    peers: list[transport.TransportEngine] = []
    try:
        rng = np.random.default_rng(23)
        size = 3 * SLOT + 777  # several slots per write: batches wait for and reuse slots
        hub_src = rng.integers(0, 256, PEERS * size, dtype=np.uint8)
        hub_dst = np.full(PEERS * size, CANARY, dtype=np.uint8)
        hub_s, hub_d = hub.register(torch.from_numpy(hub_src)), hub.register(torch.from_numpy(hub_dst))
        srcs, dsts, handles, tables = [], [], [], []
        for i in range(PEERS):
            peer = _tcp()
            peers.append(peer)
            src = rng.integers(0, 256, size, dtype=np.uint8)
            dst = np.full(size, CANARY, dtype=np.uint8)
            s, d = peer.register(torch.from_numpy(src)), peer.register(torch.from_numpy(dst))
            srcs.append(src)
            dsts.append(dst)
            inbound = np.array([[0, i * size, size]], np.int64)
            outbound = np.array([[i * size, 0, size]], np.int64)
            tables.append((inbound, outbound))
            handles.append(peer.connect(hub.address()).write(s, hub_d.descriptor(), inbound))
            handles.append(hub.connect(peer.address()).write(hub_s, d.descriptor(), outbound))
        for h in handles:
            h.wait(WAIT)
        # the hub's destination is every peer's source, back to back; each peer's is its slice of the hub's
        assert np.array_equal(hub_dst, np.concatenate(srcs))
        for i, (_, outbound) in enumerate(tables):
            assert_landed(hub_src, dsts[i], outbound)
        assert len(hub.outbound.links()) == PEERS and len(hub.inbound.links()) == PEERS
        assert 0 < hub.bounces.allocated_bytes <= budget
        assert hub.bounces.send.count == hub.bounces.recv.count == 4
    finally:
        for engine in [hub, *peers]:
            engine.close()


def test_a_stalled_slot_holder_is_cut_and_the_slot_serves_another_peer() -> None:
    # One sending slot. The first peer stops reading (its notify handler
    # blocks) while the hub's stream holds the slot mid-flood; the hub's
    # write to a second peer needs that slot and must get it.
    hub = _tcp(bounce_pool_bytes=2 * SLOT, connect_timeout=0.5)
    stalled, live = _tcp(), _tcp()
    gate = Gate(b"stall")
    try:
        src = np.random.default_rng(5).integers(0, 256, 16 << 20, dtype=np.uint8)
        s = hub.register(torch.from_numpy(src))
        far = stalled.register(torch.from_numpy(np.zeros(16 << 20, dtype=np.uint8)))
        dst = np.full(1 << 20, CANARY, dtype=np.uint8)
        near = live.register(torch.from_numpy(dst))
        stalled.set_notify_handler(gate)
        to_stalled = hub.connect(stalled.address())
        to_stalled.write(s, far.descriptor(), np.array([[0, 0, 4096]], np.int64), notify=b"stall")
        assert gate.entered.wait(WAIT)
        # More than the kernel buffers between the two (here up to 32 MiB of tcp_rmem and 4 MiB
        # of tcp_wmem): the hub's stream must end up blocked in a send, holding the slot.
        flood = [to_stalled.write(s, far.descriptor(), np.array([[0, 0, 16 << 20]], np.int64))
                 for _ in range(4)]
        table = np.array([[0, 100, SLOT * 3]], np.int64)
        t0 = time.monotonic()
        hub.connect(live.address()).write(s, near.descriptor(), table).wait(WAIT)
        assert_landed(src, dst, table)
        for handle in flood:
            with pytest.raises(PeerLostError, match="taken for stalled"):
                handle.wait(WAIT)
        assert time.monotonic() - t0 < WAIT
        assert hub.bounces.send.count == 1  # the one sending slot served both peers
    finally:
        gate.release()
        for engine in (hub, stalled, live):
            engine.close()


def test_a_freed_slot_goes_to_the_longest_waiter_not_back_to_its_holder() -> None:
    pool = BouncePool(SLOT, 2 * SLOT, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    mine, theirs = pool.bounce(sending=True), pool.bounce(sending=True)
    pool.activate()
    half = mine.half
    got, done = threading.Event(), threading.Event()

    def wait_for_the_slot() -> None:
        with theirs.lease():
            got.set()
            done.wait(WAIT)

    with mine.lease():  # the only sending slot
        waiter = threading.Thread(target=wait_for_the_slot)
        waiter.start()
        deadline = time.monotonic() + WAIT
        while not half._waiting and time.monotonic() < deadline:  # polling a predicate
            time.sleep(0.001)
        assert half._waiting, "the other stream never waited"
    # Given back; asking again at once finds the other stream first in line.
    with pytest.raises(TransferTimeout, match="no tcp bounce slot for sending freed within 0.05 s"):
        half.take(0.05)
    assert got.wait(WAIT) and not half._waiting
    done.set()
    waiter.join(WAIT)
    half.give(half.take(WAIT))  # and back to us once it is done


def test_the_pool_is_allocated_at_activation_up_to_what_the_streams_can_use() -> None:
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BouncePool(SLOT, 6 * SLOT, allocate=allocate)
    pool.bounce(sending=True)
    pool.bounce(sending=False)
    assert made == []  # no CUDA memory yet: nothing pinned
    pool.activate()
    assert made == [SLOT, SLOT] and pool.allocated_bytes == 2 * SLOT
    for _ in range(10):
        pool.bounce(sending=True)  # each new stream may use one more slot, up to the half's share
    assert pool.send.count == 3 and pool.recv.count == 1 and pool.allocated_bytes == 4 * SLOT
    with pool.bounce(sending=True).lease() as slot:
        assert slot.numel() == SLOT


def test_pool_options_are_checked() -> None:
    with pytest.raises(CapabilityError, match="at least 2 x bounce_bytes"):
        transport.create("tcp", bounce_bytes=SLOT, bounce_pool_bytes=SLOT)
    with transport.create("tcp") as engine:
        assert engine.bounces.total_bytes == DEFAULT_POOL_BYTES == 256 << 20


def test_no_slot_within_the_wait_fails_naming_the_pool() -> None:
    pool = BouncePool(SLOT, 2 * SLOT, timeout=0.05, force=True)
    bounce = pool.bounce(sending=True)
    taken = threading.Event()
    with bounce.lease():
        taken.set()
        with pytest.raises(transport.TransferTimeout, match="raise bounce_pool_bytes"):
            with bounce.lease():
                pass
