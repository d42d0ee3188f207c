"""The verbs backend over the software fabric: the fence, windows, errors, rails, options.

The conformance kit already runs on "verbs-sim" and "verbs-sim" fence='qp'; these tests pin
what is verbs-specific and what the fabric exists to catch — a `drop_peer` that fences
with QP->ERR alone lets a packet in flight land after it returns — and that fence='qp',
which cannot stop such a packet, refuses `drop_peer` (#25 item 6).
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError, PeerLostError, TransferTimeout
from pdxfer.transport.verbs.inbound import InboundPeer
from pdxfer.transport.verbs.nics import probe
from pdxfer.transport.verbs.sim import namespace as soft
from pdxfer.transport.verbs.sim import verbs as soft_verbs

from pdxfer import transport

API = soft()
S = API.E.ibv_wc_status
RW = int(API.E.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE | API.E.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE)
WAIT = 10.0
HARDWARE = probe()


# -- the fence ----------------------------------------------------------------------

def _bytes_after_drop(monkeypatch: pytest.MonkeyPatch, err_only: bool) -> bool:
    """Whether bytes landed after `drop_peer` returned, with one packet caught mid-flight."""
    if err_only:  # the broken fence: QP->ERR and destroy, the link's MRs never closed
        monkeypatch.setattr(InboundPeer, "revoke", lambda self: None)
        monkeypatch.setattr(InboundPeer, "drop_mr", lambda self, region_id: None)
    fab = soft_verbs.fabric()
    tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim")
    src = torch.from_numpy(np.random.default_rng(3).integers(1, 256, 4 << 20, dtype=np.uint8))
    dst = np.zeros(4 << 20, np.uint8)
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    snapshot: list[np.ndarray] = []
    try:
        a, b = tx.register(src), rx.register(torch.from_numpy(dst))
        conn = tx.connect(rx.address())
        qpn = conn.qpns[0]

        def hold(q: int, key: int) -> None:
            if q == qpn and not entered.is_set():
                entered.set()
                release.wait(WAIT)

        fab.on_packet = hold
        handle = conn.write(a, b.descriptor(), np.array([[0, 0, 4 << 20]], np.int64))
        assert entered.wait(WAIT)

        def drop() -> None:
            rx.drop_peer(tx.engine_id)
            snapshot.append(dst.copy())
            returned.set()
            with fab.lock:
                fab.lock.notify_all()

        dropper = threading.Thread(target=drop)
        dropper.start()
        with fab.lock:  # drop_peer returned, or its MR close waits on the held packet
            assert fab.lock.wait_for(lambda: returned.is_set() or fab.closers_waiting, WAIT)
        release.set()
        dropper.join(WAIT)
        with fab.lock:
            assert fab.lock.wait_for(lambda: not any(fab.inflight.values()), WAIT)
        with pytest.raises(PeerLostError):
            handle.wait(WAIT)
        return not np.array_equal(dst, snapshot[0])
    finally:
        fab.on_packet = None
        release.set()
        tx.close()
        rx.close()


def test_drop_peer_is_a_fence_even_with_a_packet_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _bytes_after_drop(monkeypatch, err_only=False)


def test_a_fence_of_qp_err_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _bytes_after_drop(monkeypatch, err_only=True), "the fabric let an ERR-only fence pass"


def test_fence_qp_declares_no_fence_and_drop_peer_refuses() -> None:
    # #25 item 6: fence="qp" shares one MR per region among links, so a packet in flight
    # can land after its QP went to ERR (the ERR-only fence above): it declares fence=False
    # and drop_peer refuses instead of returning as if it had fenced. (It returned before.)
    tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim", fence="qp")
    try:
        assert rx.capabilities.fence is False
        src = rx.register(torch.zeros(4096, dtype=torch.uint8))
        a = tx.register(torch.ones(4096, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        conn.write(a, src.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)
        with pytest.raises(CapabilityError, match=r"cannot fence a peer: it was created with "
                                                  r"fence='qp'.*use fence='mr'"):
            rx.drop_peer(tx.engine_id)
        assert rx.has_peer(tx.engine_id)
        conn.write(a, src.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)  # link intact
    finally:
        tx.close()
        rx.close()


# -- the backend over the fabric ----------------------------------------------------

@pytest.fixture
def link():
    tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim")
    src = torch.from_numpy(np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8))
    dst = np.zeros(8 << 20, np.uint8)
    a, b = tx.register(src), rx.register(torch.from_numpy(dst))
    yield tx, rx, tx.connect(rx.address()), a, b, src.numpy(), dst
    tx.close()
    rx.close()


def test_windows_gather_split_and_signal(link) -> None:
    tx, rx, conn, a, b, src, dst = link
    # 600 rows of 1 KiB scattered at the source, contiguous at the destination: gathered 8 per WR
    rows = np.stack([np.arange(600) * 4096, np.arange(600) * 1024, np.full(600, 1024)], 1).astype(np.int64)
    conn.write(a, b.descriptor(), rows).wait(WAIT)
    assert conn.wrs == 75 + 1 and conn.doorbells == 1
    assert np.array_equal(dst[:600 * 1024].reshape(600, 1024), src.reshape(-1, 4096)[:600, :1024])
    # one 3 MiB row: split at the 1 MiB max message size
    before = conn.wrs
    conn.write(a, b.descriptor(), np.array([[0, 4 << 20, 3 << 20]], np.int64)).wait(WAIT)
    assert conn.wrs - before == 3 + 1
    # 700 scattered rows: more WRs than the 256-deep SQ, posted in several windows
    rows = np.stack([np.arange(700) * 64, np.arange(700) * 128, np.full(700, 64)], 1).astype(np.int64)
    doorbells = conn.doorbells
    conn.write(a, b.descriptor(), rows).wait(WAIT)
    assert conn.doorbells - doorbells >= 3
    assert np.array_equal(dst[:700 * 128].reshape(700, 128)[:, :64], src[:700 * 64].reshape(700, 64))


def test_completion_error_is_named_severs_and_reconnect_builds_fresh_qps(link) -> None:
    tx, rx, conn, a, b, src, dst = link
    old_qpn = conn.qpns[0]
    soft_verbs.fabric().fail_next(old_qpn, int(S.IBV_WC_REM_ACCESS_ERR))
    handle = conn.write(a, b.descriptor(), np.array([[0, 0, 4096]], np.int64))
    with pytest.raises(PeerLostError, match=r"remote access error \(status 10"):
        handle.wait(WAIT)
    assert not conn.alive
    fresh = tx.connect(rx.address())
    assert fresh is not conn and fresh.qpns[0] != old_qpn
    fresh.write(a, b.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)
    assert np.array_equal(dst[:4096], src[:4096])


def test_reconnect_after_drop_gets_new_rkeys_and_old_ones_are_dead(link) -> None:
    tx, rx, conn, a, b, src, dst = link
    old = conn.peer_regions[b.region_id].info[1]  # the rkey
    rx.drop_peer(tx.engine_id)
    with pytest.raises(PeerLostError):
        conn.write(a, b.descriptor(), np.array([[0, 0, 64]], np.int64)).wait(WAIT)
    fresh = tx.connect(rx.address())
    new = fresh.peer_regions[b.region_id].info[1]
    assert new != old and old not in soft_verbs.fabric().mrs
    fresh.write(a, b.descriptor(), np.array([[0, 0, 64]], np.int64)).wait(WAIT)
    assert np.array_equal(dst[:64], src[:64])


def test_rails_stripe_and_notify_waits_for_every_rail() -> None:
    fab = soft_verbs.fabric()
    tx, rx = transport.create("verbs-sim", rails=3), transport.create("verbs-sim", rails=3)
    try:
        src = torch.from_numpy(np.random.default_rng(9).integers(0, 256, 8 << 20, dtype=np.uint8))
        dst = np.zeros(8 << 20, np.uint8)
        a, b = tx.register(src), rx.register(torch.from_numpy(dst))
        notes: list[bytes] = []
        rx.set_notify_handler(lambda sender, payload: notes.append(payload))
        conn = tx.connect(rx.address())
        qpns = conn.qpns
        assert len(set(qpns)) == 3
        bells = [fab.doorbells[q] for q in qpns]
        fab.pause(qpns[2])  # the last stripe (and its note, which carries the payload) waits
        table = np.array([[0, 0, 6 << 20]], np.int64)
        handle = conn.write(a, b.descriptor(), table, notify=b"all")
        try:
            with fab.lock:  # rails 0 and 1 placed every byte and their notes
                assert fab.lock.wait_for(lambda: not fab.qps[qpns[0]].sq and not fab.qps[qpns[1]].sq, WAIT)
            (peer,) = [p for p in rx.inbound.links() if p.sender]
            deadline = time.monotonic() + WAIT
            while not peer.partial and time.monotonic() < deadline:
                time.sleep(0.005)  # polling a predicate: the receiver's progress picks the notes up
            assert peer.partial, "the receiver never collected the first rails' notes"
            with pytest.raises(TransferTimeout):
                handle.wait(0.05)
            assert notes == [] and not np.array_equal(dst[4 << 20:6 << 20], src.numpy()[4 << 20:6 << 20])
        finally:
            fab.pause(qpns[2], False)
        handle.wait(WAIT)
        assert notes == [b"all"] and np.array_equal(dst[:6 << 20], src.numpy()[:6 << 20])
        assert all(fab.doorbells[q] > n for q, n in zip(qpns, bells, strict=True))
        small = conn.write(a, b.descriptor(), np.array([[0, 7 << 20, 100]], np.int64), notify=b"one")
        small.wait(WAIT)  # under RAIL_MIN: one rail, one note
        assert notes == [b"all", b"one"]
    finally:
        tx.close()
        rx.close()


@pytest.mark.skipif(HARDWARE is None, reason="an RDMA port is ACTIVE here: 'verbs' is listed")
def test_verbs_is_listed_only_with_an_active_port_and_says_why_not() -> None:
    assert "verbs" not in transport.available() and "verbs-sim" in transport.available()
    with pytest.raises(CapabilityError, match=r"transport 'verbs' is not installed \(python3-pyverbs "
                                              r"and an ACTIVE RDMA port\): " + re.escape(HARDWARE)):
        transport.create("verbs")


def test_fence_qp_mode_moves_bytes_and_reconnects() -> None:
    tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim", fence="qp")
    try:
        src = torch.from_numpy(np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8))
        dst = np.zeros(1 << 20, np.uint8)
        a, b = tx.register(src), rx.register(torch.from_numpy(dst))
        table = np.array([[0, 0, 1 << 19], [1 << 19, (1 << 19) + 64, 1000]], np.int64)
        first = tx.connect(rx.address())
        first.write(a, b.descriptor(), table).wait(WAIT)
        first.close()  # the receiver fences the link on Bye (its QPs; the shared MR stays)
        with pytest.raises((PeerLostError, transport.ClosedError)):
            first.write(a, b.descriptor(), table).wait(WAIT)
        dst[:] = 0
        again = tx.connect(rx.address())
        again.write(a, b.descriptor(), table).wait(WAIT)
        assert np.array_equal(dst[:1 << 19], src.numpy()[:1 << 19])
        assert np.array_equal(dst[(1 << 19) + 64:(1 << 19) + 1064], src.numpy()[1 << 19:(1 << 19) + 1000])
        with pytest.raises(CapabilityError, match="fence='x'"):
            transport.create("verbs-sim", fence="x")
    finally:
        tx.close()
        rx.close()
