"""No wait under a lock, none on the progress thread: WR building, acks, per-link registration.

The verbs engine has one progress thread for every link's completions and notes. Each test
makes one link (or one sender) slow in the way the issue names and checks that the others
do not notice: work requests are built with the link lock free; an ack that cannot go out
now (its socket full, or another frame being sent on it) waits in its link while other
links' notes are delivered; registering a region for one link (seconds of pinning for a
large pool) holds no lock another link's completions need.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
from pdxfer.transport import control
from pdxfer.transport.control import Gone, seqs_of
from pdxfer.transport.inbound import InboundTable
from pdxfer.transport.verbs import build
from pdxfer.transport.verbs import inbound as verbs_inbound
from pdxfer.transport.verbs import wire as verbs_wire

from pdxfer import transport

WAIT = 10.0
QUICK = 2.0  # a bound for "at once" that load cannot reach, far below every wait it guards


def _table(offset: int = 0, n: int = 4096) -> np.ndarray:
    return np.array([[offset, offset, n]], np.int64)


@pytest.fixture
def two_senders():
    a, b, rx = (transport.create("verbs-sim") for _ in range(3))
    dst = rx.register(torch.zeros(1 << 20, dtype=torch.uint8))
    srcs = [e.register(torch.ones(1 << 20, dtype=torch.uint8)) for e in (a, b)]
    conns = [e.connect(rx.address()) for e in (a, b)]
    peers = {p.sender: p for p in rx.inbound.links() if p.sender}
    yield (a, b, rx), conns, srcs, dst, (peers[a.engine_id], peers[b.engine_id])
    for e in (a, b, rx):
        e.close()


def test_work_requests_are_built_with_the_link_lock_free(two_senders, monkeypatch) -> None:
    _, (conn, _), (src, _), dst, _ = two_senders
    free: list[bool] = []
    real = build.write_wrs

    def try_lock() -> None:
        took = conn.lock.acquire(blocking=False)
        if took:
            conn.lock.release()
        free.append(took)

    def probing(*args, **kwargs):  # can another thread take the link lock while WRs are built?
        t = threading.Thread(target=try_lock)
        t.start()
        t.join(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "write_wrs", probing)
    rows = np.stack([np.arange(64) * 8192, np.arange(64) * 8192, np.full(64, 4096)], 1).astype(np.int64)
    conn.write(src, dst.descriptor(), rows).wait(WAIT)
    assert free == [True], "work requests were built while the link lock was held"


def test_an_ack_that_cannot_go_out_never_holds_up_other_links(two_senders) -> None:
    (_, _, rx), (conn_a, conn_b), (src_a, src_b), dst, (peer_a, _) = two_senders
    notified = threading.Event()
    rx.set_notify_handler(lambda sender, payload: payload == b"a" and notified.set())
    # Something else is being sent to sender A (a region table, a Gone) and its socket is full:
    # the control socket's send lock stays taken. A's ack must wait for it; B's must not.
    assert peer_a.send_lock.acquire(timeout=WAIT)
    try:
        handle_a = conn_a.write(src_a, dst.descriptor(), _table(0), notify=b"a")
        assert notified.wait(WAIT)  # A's transfer landed and its notify ran; its ack cannot go
        t0 = time.monotonic()
        conn_b.write(src_b, dst.descriptor(), _table(8192)).wait(QUICK)  # delivered and acked meanwhile
        assert time.monotonic() - t0 < QUICK
        assert not handle_a.poll() and peer_a.unacked
    finally:
        peer_a.send_lock.release()
    handle_a.wait(WAIT)  # the progress thread sends it once the socket is free


class _Inbound(control.ControlInbound):
    """A link past its handshake (its `Welcome` said), over a socket pair: no `run()`."""

    WIRE = verbs_wire

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._welcomed = True  # else a `Gone` waits for the Welcome this link never sends


class _Slot:
    def admitted(self) -> None:
        pass


def test_acks_to_a_sender_that_stopped_reading_queue_whole_and_go_out_in_order(monkeypatch) -> None:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    link = _Inbound(InboundTable("t", lambda s, p: None), ours, "pair", _Slot())
    try:
        # Frames of 2,000 acks (16 KiB) are larger than the socket holds: the first is cut.
        sent, batch = 0, list(range(2000))
        while not link.unacked:
            t0 = time.monotonic()
            link.ack_nowait([sent + i for i in batch])
            assert time.monotonic() - t0 < QUICK, "ack_nowait waited on the socket"
            sent += len(batch)
            assert sent < 1_000_000, "the socket never filled"
        link.ack_nowait([sent])  # more while stuck: queued behind the unsent frame
        sent += 1
        replying = threading.Thread(target=link.send, args=(Gone(7),))  # a reply while an ack is cut
        replying.start()
        got: list[int] = []
        gone: list = []
        received = b""
        theirs.settimeout(WAIT)
        while len(got) < sent or not gone:
            received += theirs.recv(1 << 16)
            link.flush_acks()  # the progress thread's next rounds
            while len(received) >= 4 and len(received) >= 4 + int.from_bytes(received[:4], "big"):
                n = 4 + int.from_bytes(received[:4], "big")
                msg = verbs_wire.CONTROL.unpack(received[4:n])  # a cut frame fails to unpack
                if isinstance(msg, Gone):
                    gone.append(msg)
                else:
                    got += seqs_of(msg)
                received = received[n:]
        replying.join(WAIT)
        assert got == list(range(sent)) and gone == [Gone(7)] and not link.unacked
        # a sender that takes nothing for SEND_TIMEOUT is fenced
        monkeypatch.setattr(control, "SEND_TIMEOUT", 0.05)
        while not link.unacked:
            link.ack_nowait(batch)
        deadline = time.monotonic() + WAIT
        while not link.dead and time.monotonic() < deadline:
            link.flush_acks()
            time.sleep(0.01)  # polling a predicate: the stall must outlast SEND_TIMEOUT
        assert link.dead
    finally:
        ours.close()
        theirs.close()


def test_a_reply_carries_the_acks_queued_before_it() -> None:
    # Acks queued while another frame held the socket go out ahead of the next reply, not on a
    # `flush_acks` the progress thread may never need to make again (CI once hung there).
    ours, theirs = socket.socketpair()
    link = _Inbound(InboundTable("t", lambda s, p: None), ours, "pair", _Slot())
    try:
        with link.send_lock:  # a reply is being sent: the ack cannot go now
            link.ack_nowait([1, 2, 3])
        assert link.unacked
        link.send(Gone(7))
        assert not link.unacked, "the reply left acks behind"
        theirs.settimeout(WAIT)
        first, second = (verbs_wire.CONTROL.recv(theirs) for _ in range(2))
        assert seqs_of(first) == [1, 2, 3] and second == Gone(7)
    finally:
        ours.close()
        theirs.close()


def test_registering_a_region_for_one_link_stalls_no_other_links_completions(
        two_senders, monkeypatch) -> None:
    (_, _, rx), (_, conn_b), (_, src_b), dst, (peer_a, _) = two_senders
    big = torch.zeros(1 << 16, dtype=torch.uint8)
    pinning, release = threading.Event(), threading.Event()
    real = verbs_inbound.register_mr

    def slow(api, pd, region, access):  # the link's MR of the new region: seconds of pinning
        if region.start == big.data_ptr() and threading.current_thread() is registering:
            pinning.set()
            release.wait(WAIT)
        return real(api, pd, region, access)

    monkeypatch.setattr(verbs_inbound, "register_mr", slow)
    registering = threading.Thread(target=rx.register, args=(big,))
    registering.start()
    try:
        assert pinning.wait(WAIT)
        t0 = time.monotonic()
        conn_b.write(src_b, dst.descriptor(), _table()).wait(QUICK)
        assert time.monotonic() - t0 < QUICK
        assert peer_a.lock.acquire(timeout=QUICK), "the link's lock is held while its MR registers"
        peer_a.lock.release()
        other = threading.Thread(target=rx.register, args=(torch.zeros(4096, dtype=torch.uint8),))
        other.start()  # another region, registered for every link meanwhile
        other.join(QUICK)
        assert not other.is_alive(), "a registration waited for another link's pinning"
        with transport.create("verbs-sim") as late:  # and a new sender is admitted meanwhile
            late_src = late.register(torch.ones(4096, dtype=torch.uint8))
            late.connect(rx.address()).write(late_src, dst.descriptor(), _table()).wait(QUICK)
    finally:
        release.set()
        registering.join(WAIT)
    assert len(rx.regions.live()) == 3
