"""The conformance suite's fault cases: a peer that stalls, closes, is dropped or is killed.

Same `rig` fixture as test_conformance.py (every backend), split off by topic: these pin
that a waiting side never hangs, that `drop_peer` is a fence or refuses, and that close
and process death fail what is in flight with the documented errors.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from pdxfer.transport import CapabilityError, ClosedError, PeerLostError, TransferTimeout
from segment_tables import assert_landed
from transport_rig import (
    WAIT,
    Gate,
    Rig,
    assert_untouched_then_usable,
    can_fence,
    good_table,
    needs_fence,
)


def _stall(rig: Rig) -> tuple[Gate, object, np.ndarray]:
    """Stall the receiver in a notify handler, then post a 4 MiB transfer behind it."""
    gate = Gate(b"stall")
    rig.on_notify = gate
    rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"stall")
    assert gate.entered.wait(WAIT)
    big = np.array([[0, 4 << 20, 4 << 20]], np.int64)
    return gate, rig.conn.write(rig.src_region, rig.remote, big, notify=b"big"), big


def test_wait_times_out_while_peer_stalls(rig: Rig) -> None:
    gate, handle, _ = _stall(rig)
    try:
        with pytest.raises(TransferTimeout, match=r"not complete after 0.2 s"):
            handle.wait(0.2)
        assert handle.poll() is False
    finally:
        gate.release()
    handle.wait(WAIT)


def test_peer_closed_mid_transfer_fails_with_peer_lost(rig: Rig) -> None:
    gate, handle, big = _stall(rig)
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


def test_drop_peer_is_a_fence_or_refuses(rig: Rig) -> None:
    # A backend whose transports write without the receiver's action cannot
    # fence: it must say so, never return as if it had.
    rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
    if can_fence(rig.rx):
        rig.rx.drop_peer(rig.tx.engine_id)
        with pytest.raises(PeerLostError):
            rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
    else:
        with pytest.raises(CapabilityError, match="cannot fence a peer"):
            rig.rx.drop_peer(rig.tx.engine_id)


def test_drop_peer_fences_earlier_writes(rig: Rig) -> None:
    needs_fence(rig)
    # The receiver is held inside the notify handler of a first transfer while
    # a 4 MiB one is posted behind it, then fences from that handler: a fence
    # waits for a running handler (it may not deliver past it), so fencing from
    # any other thread would wait for the very stall that keeps `big` in flight.
    big = np.array([[0, 4 << 20, 4 << 20]], np.int64)
    big_posted, fenced, after_fence = threading.Event(), threading.Event(), {}

    def stall_then_fence(sender: str, payload: bytes) -> None:
        if payload == b"stall":
            assert big_posted.wait(WAIT)
            rig.rx.drop_peer(sender)
            after_fence["dst"] = rig.dst.copy()
            fenced.set()
        else:
            rig.notes.append((sender, payload))

    rig.on_notify = stall_then_fence
    rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"stall")
    handle = rig.conn.write(rig.src_region, rig.remote, big, notify=b"big")
    big_posted.set()
    with pytest.raises(PeerLostError):
        handle.wait(WAIT)
    # test_fence.py proves the fence with a step held inside the receiving path;
    # here the later bytes simply must not have changed anything since it returned.
    assert fenced.wait(WAIT), "the handler never ran its fence"
    assert np.array_equal(rig.dst, after_fence["dst"]), "bytes landed after drop_peer returned"
    assert b"big" not in [p for _, p in rig.notes]
    # The dropped peer may connect again.
    rig.on_notify = None
    rig.refill()
    conn = rig.tx.connect(rig.rx.address())
    conn.write(rig.src_region, rig.remote, big).wait(WAIT)
    assert_landed(rig.src, rig.dst, big)


def test_drop_peer_from_inside_the_notify_handler_does_not_deadlock(rig: Rig) -> None:
    needs_fence(rig)
    returned = threading.Event()

    def drop(sender: str, payload: bytes) -> None:
        rig.rx.drop_peer(sender)  # on the backend's own I/O thread
        returned.set()

    rig.on_notify = drop
    handle = rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"drop")
    assert returned.wait(WAIT), "drop_peer called from the notify handler never returned"
    try:  # the data landed before the notify; whether the ack still got out is backend timing
        handle.wait(WAIT)
    except PeerLostError:
        pass
    assert_landed(rig.src, rig.dst, good_table())


def test_close_during_transfer_fails_in_flight_with_closed_error(rig: Rig) -> None:
    gate, handle, _ = _stall(rig)
    # close() may wait (bounded) for a worker that is running the receiver's
    # handler (loopback runs it on the sender's thread): close from a thread,
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
    needs_fence(rig)  # the rest reuses the destination, which needs the fence
    # The contract (transport.base.Connection.close): closing the *sender's*
    # connection stops it sending; bytes it already handed to the network may
    # still land until the receiver fences it. So the receiver fences before
    # the test refills its canary — without this, late tcp bytes land after.
    rig.rx.drop_peer(rig.tx.engine_id)
    # A fresh connection to the same peer works.
    rig.on_notify = None
    rig.refill()
    rig.conn = rig.tx.connect(rig.rx.address())
    assert_untouched_then_usable(rig)




PEER = Path(__file__).with_name("peer_proc.py")


def _spawn_peer(backend: str, nbytes: int) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen(
        [sys.executable, str(PEER), backend, str(nbytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    ready, _, _ = select.select([child.stdout], [], [], 60)
    line = child.stdout.readline() if ready else b""
    if not line:
        child.kill()
        child.wait()
        pytest.fail(f"peer process did not start (exit code {child.poll()})")
    return child, msgpack.unpackb(bytes.fromhex(line.decode()))


def test_peer_process_killed_mid_transfer_fails_waiter_within_bound(rig: Rig) -> None:
    if not rig.tx.capabilities.cross_process:
        pytest.skip(
            f"{rig.backend} engines share one process, so there is no peer process to kill; "
            "its peer loss is pinned by test_peer_closed_mid_transfer_fails_with_peer_lost"
        )
    child, info = _spawn_peer(rig.backend, 64 << 20)
    try:
        conn = rig.tx.connect(info["address"])
        conn.write(rig.src_region, info["descriptor"], good_table()).wait(WAIT)  # link is live
        os.kill(child.pid, signal.SIGSTOP)  # frozen: 64 MiB cannot fit in socket buffers
        rows = np.arange(16, dtype=np.int64) * (4 << 20)
        table = np.stack([np.zeros(16, np.int64), rows, np.full(16, 4 << 20)], 1)
        handle = conn.write(rig.src_region, info["descriptor"], table, notify=b"lost")
        with pytest.raises(TransferTimeout):
            handle.wait(0.5)  # a stalled peer is a timeout, not a hang
        os.kill(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            handle.wait(10)
        assert time.monotonic() - t0 < 10
        with pytest.raises(PeerLostError):
            conn.write(rig.src_region, info["descriptor"], good_table())
        # Reaped first: a process still dying may answer a connect with a reset
        # (its listener not yet closed); once reaped, every socket of it is gone.
        child.wait(WAIT)
        with pytest.raises(PeerLostError, match="cannot connect"):
            rig.tx.connect(info["address"])
    finally:
        child.kill()
        child.wait()
