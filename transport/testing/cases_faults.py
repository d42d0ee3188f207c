"""Kit cases: a peer that stalls, closes, is dropped or is killed never hangs or slows the other side.

A waiting side never hangs (timeouts, `PeerLostError`, `ClosedError` as
documented); a stalled peer — frozen with SIGSTOP where it is another
process, held at a notify gate where it shares ours — never delays a post
to any other peer; `has_peer` tells a receiver when a sender is gone.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import torch

from ..errors import ClosedError, PeerLostError, TransferTimeout
from .rig import (
    WAIT,
    Backend,
    Gate,
    PeerPool,
    Rig,
    good_table,
    need,
    until,
)
from .tables import CANARY, assert_landed


def _stall(rig: Rig) -> tuple[Gate, object]:
    """Stall the receiver in a notify handler, then post a 4 MiB transfer behind it."""
    gate = Gate(b"stall")
    rig.on_notify = gate
    rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"stall")
    assert gate.entered.wait(WAIT)
    big = np.array([[0, 4 << 20, 4 << 20]], np.int64)
    return gate, rig.conn.write(rig.src_region, rig.remote, big, notify=b"big")


def test_wait_times_out_while_peer_stalls(backend: Backend) -> None:
    with Rig(backend) as rig:
        gate, handle = _stall(rig)
        try:
            with pytest.raises(TransferTimeout, match=r"not complete after 0.2 s"):
                handle.wait(0.2)
            assert handle.poll() is False
        finally:
            gate.release()
        handle.wait(WAIT)


def test_peer_closed_mid_transfer_fails_with_peer_lost(backend: Backend) -> None:
    with Rig(backend) as rig:
        gate, handle = _stall(rig)
        closer = threading.Thread(target=rig.rx.close)
        closer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(PeerLostError):
                handle.wait(10)
            assert time.monotonic() - t0 < 10
        finally:
            gate.release()
            closer.join(WAIT)
        assert not closer.is_alive(), "receiver close() did not return"
        assert b"big" not in [p for _, p in rig.notes]


def test_close_during_transfer_fails_in_flight_with_closed_error(backend: Backend) -> None:
    with Rig(backend) as rig:
        gate, handle = _stall(rig)
        # close() may wait (bounded) for a worker that is running the receiver's
        # handler (loopback runs it on the link's worker): close from a thread,
        # see the in-flight transfer fail, then let the handler go.
        closer = threading.Thread(target=rig.conn.close)
        closer.start()
        try:
            with pytest.raises(ClosedError):
                handle.wait(WAIT)
        finally:
            gate.release()
            closer.join(WAIT)
        assert not closer.is_alive(), "close() did not return once the handler let go"
        rig.conn.close()  # idempotent
        with pytest.raises((ClosedError, PeerLostError)):
            rig.conn.write(rig.src_region, rig.remote, good_table())
        need(rig.rx, "fence", "the rest reuses the destination, which needs the fence")
        # The contract (transport.base.Connection.close): closing the *sender's*
        # connection stops it sending; bytes it already handed to the network may
        # still land until the receiver fences it. So the receiver fences before
        # the case refills its canary.
        rig.rx.drop_peer(rig.tx.engine_id)
        rig.on_notify = None
        rig.refill()
        rig.conn = rig.tx.connect(rig.rx.address())
        good = np.array([[0, 2 << 20, 4096]], np.int64)
        rig.conn.write(rig.src_region, rig.remote, good).wait(WAIT)
        assert_landed(rig.src, rig.dst, good)


def test_engine_close_is_idempotent_and_refuses_later_use(backend: Backend) -> None:
    with Rig(backend) as rig:
        rig.tx.close()
        rig.tx.close()
        with pytest.raises(ClosedError):
            rig.tx.register(np.zeros(8, np.uint8))
        with pytest.raises((ClosedError, PeerLostError)):
            rig.conn.write(rig.src_region, rig.remote, good_table())
        with pytest.raises(ClosedError):
            rig.tx.connect(rig.rx.address())


def test_has_peer_is_true_while_a_sender_is_linked_and_false_once_it_closed(backend: Backend) -> None:
    with Rig(backend) as rig:
        assert isinstance(rig.rx.capabilities.fence, bool)
        sender = rig.tx.engine_id
        rig.conn.write(rig.src_region, rig.remote, np.array([[0, 0, 4096]], np.int64),
                       notify=b"x").wait(WAIT)
        rig.wait_notes(1)
        assert rig.rx.has_peer(sender), "a sender whose link is open must count as present"
        assert not rig.rx.has_peer("no-such-engine")
        rig.tx.close()
        assert until(lambda: not rig.rx.has_peer(sender)), (
            f"{backend.label}: has_peer still True after the sender's engine closed")


# How long one post to a live peer may take on the caller's thread while another peer is
# stalled: local work only, on a loaded machine.
POST_BOUND = 1.0
REQUESTS = 20


def _flood() -> np.ndarray:
    """16 rows of 256 KiB: 4 MiB per write, more than socket buffers or credits take at once."""
    rows = np.arange(16, dtype=np.int64) * (256 << 10)
    return np.stack([np.zeros(16, np.int64), rows, np.full(16, 256 << 10)], 1)


def test_a_stalled_peer_never_delays_a_post_to_another_peer(backend: Backend, kit_peers: PeerPool) -> None:
    """Done-when of #19: stall one receiving peer, another peer's requests go through meanwhile.

    Across processes the stalled peer is frozen with SIGSTOP (its process's peer is the
    one `test_peer_process_killed_...` then kills); in one process it is held in its
    notify handler. Either way a flood waits on the stalled link while every post to a
    live peer returns at once and completes.
    """
    with Rig(backend) as rig, backend.create() as other:
        dst = np.full(1 << 20, CANARY, np.uint8)
        region = other.register(torch.from_numpy(dst))
        live = rig.tx.connect(other.address())
        gate, peer = None, None
        if rig.tx.capabilities.cross_process and backend.spawn is not None:
            peer = kit_peers.get(backend)
            stalled = rig.tx.connect(peer.address)
            stalled.write(rig.src_region, peer.descriptor, good_table()).wait(WAIT)
            peer.freeze()
            target = peer.descriptor
        else:
            gate = Gate(b"stall")  # in-process: the receiver holds its side of the link
            rig.on_notify = gate
            stalled = rig.conn
            stalled.write(rig.src_region, rig.remote, good_table(), notify=b"stall")
            assert gate.entered.wait(WAIT)
            target = rig.remote
        try:
            held = [stalled.write(rig.src_region, target, _flood()) for _ in range(16)]
            worst, handles = 0.0, []
            for i in range(REQUESTS):
                table = np.array([[i * 4096, i * 8192, 4096]], np.int64)
                t = time.monotonic()
                handles.append(live.write(rig.src_region, region.descriptor(), table))
                worst = max(worst, time.monotonic() - t)
            for h in handles:
                h.wait(WAIT)
            assert worst < POST_BOUND, f"a post to the live peer took {worst:.3f} s"
            if not rig.tx.capabilities.one_sided:
                # A one-sided transport (nixl-all's cma) writes into a stopped process and
                # completes without it (DONE, #23): there the flood may well land.
                assert not all(h.poll() for h in held), "the stalled peer took the whole flood"
            expected = np.array([[i * 4096, i * 8192, 4096] for i in range(REQUESTS)], np.int64)
            assert_landed(rig.src, dst, expected)
        finally:
            if gate is not None:
                gate.release()
            if peer is not None:
                stalled.close()  # the flood is abandoned; the peer resumes for the next case
                peer.signal(signal.SIGCONT)


def test_peer_process_killed_mid_transfer_fails_waiter_within_bound(backend: Backend,
                                                                     kit_peers: PeerPool) -> None:
    need(backend, "cross_process", "its engines share one process: no peer process to kill")
    if backend.spawn is None:
        pytest.skip(f"{backend.label}: the kit was given no way to start a peer process")
    with Rig(backend) as rig:
        peer = kit_peers.take(backend)
        try:
            conn = rig.tx.connect(peer.address)
            conn.write(rig.src_region, peer.descriptor, good_table()).wait(WAIT)  # link is live
            peer.freeze()  # frozen: 64 MiB cannot fit in socket buffers
            rows = np.arange(16, dtype=np.int64) * (4 << 20)
            table = np.stack([np.zeros(16, np.int64), rows, np.full(16, 4 << 20)], 1)
            handle = conn.write(rig.src_region, peer.descriptor, table, notify=b"lost")
            with pytest.raises(TransferTimeout):
                handle.wait(0.5)  # a stalled peer is a timeout, not a hang
            peer.signal(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(PeerLostError):
                handle.wait(10)
            assert time.monotonic() - t0 < 10
            with pytest.raises(PeerLostError):
                conn.write(rig.src_region, peer.descriptor, good_table())
            # Reaped first: a process still dying may answer a connect with a reset
            # (its listener not yet closed); once reaped, every socket of it is gone.
            peer.child.wait(WAIT)
            with pytest.raises(PeerLostError, match="cannot connect"):
                rig.tx.connect(peer.address)
        finally:
            peer.kill()
