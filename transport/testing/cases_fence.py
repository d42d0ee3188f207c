"""Kit cases: `drop_peer` is a fence or refuses, and no notify starts after it returns.

Where `capabilities.fence` is True, after `drop_peer` returns no byte of the
dropped peer's earlier writes changes our memory and no notify of it
starts; where it is False, `drop_peer` raises `CapabilityError` and never
returns as if it had fenced. The notify case holds the kit's delivery point
(`InboundTable.notify`, between "this transfer landed and its link is not
fenced" and the handler call) at a gate and fences from another thread: a
correct fence waits for the held delivery; a broken one returns while it is
held, and the delivery then runs after it.

`settled` (#25.1) — what a receiver that cannot fence asks before it reuses
memory — says False while a link of that sender is open, and True once it
has ended *with proof*: on every backend whose own stop of a link proves
nothing more lands (`cut_settles`), the end itself; where the sender writes
into our memory unstoppably (nixl-all, verbs `fence="qp"`, ucx-all), only
the sender's `Bye(quiet=True)` after its drain — withheld here, the link
stays unsettled after it ended. `refuse_new_links` holds a sender's new
links off until its old ones settled, then lifts by itself.
"""


from __future__ import annotations

import threading

import numpy as np
import pytest

from ..errors import CapabilityError, PeerLostError, TransportError
from .rig import SRC_BYTES, WAIT, Backend, Rig, StepGate, drop_while_gated, good_table, need, until
from .tables import assert_landed

# How long a broken fence is given to return while the gated step is held: a
# correct fence passes whatever this is, a broken one returns within microseconds.
FENCE_WAIT = 1.0


def test_drop_peer_is_a_fence_or_refuses(backend: Backend) -> None:
    # A backend whose transports write without the receiver's action cannot
    # fence: it must say so, never return as if it had.
    with Rig(backend) as rig:
        rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
        if rig.rx.capabilities.fence:
            rig.rx.drop_peer(rig.tx.engine_id)
            with pytest.raises(PeerLostError):
                rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
            assert not rig.rx.has_peer(rig.tx.engine_id)
        else:
            with pytest.raises(CapabilityError, match="cannot fence a peer"):
                rig.rx.drop_peer(rig.tx.engine_id)
            assert rig.rx.has_peer(rig.tx.engine_id), "a refused fence dropped the link anyway"


def test_drop_peer_fences_earlier_writes(backend: Backend) -> None:
    # The receiver is held inside the notify handler of a first transfer while
    # a 4 MiB one is posted behind it, then fences from that handler: a fence
    # waits for a running handler (it may not deliver past it), so fencing from
    # any other thread would wait for the very stall that keeps `big` in flight.
    with Rig(backend) as rig:
        need(rig.rx, "fence")
        big = np.array([[0, 4 << 20, 4 << 20]], np.int64)
        big_posted, fenced, after_fence = threading.Event(), threading.Event(), {}
        late: list[bytes] = []

        def stall_then_fence(sender: str, payload: bytes) -> None:
            if payload == b"stall":
                assert big_posted.wait(WAIT)
                rig.rx.drop_peer(sender)
                after_fence["dst"] = rig.dst.copy()
                fenced.set()
            elif fenced.is_set():
                late.append(payload)  # delivered after the fence returned

        rig.on_notify = stall_then_fence
        rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"stall")
        handle = rig.conn.write(rig.src_region, rig.remote, big, notify=b"big")
        big_posted.set()
        assert fenced.wait(WAIT), "the handler never ran its fence"
        try:  # the big transfer may have landed (and been confirmed) before the fence
            handle.wait(WAIT)
        except PeerLostError:
            pass
        # the later bytes simply must not have changed anything since the fence returned
        assert np.array_equal(rig.dst, after_fence["dst"]), "bytes landed after drop_peer returned"
        assert late == [], f"notify {late} handed to the handler after drop_peer returned"
        # The dropped peer may connect again.
        rig.on_notify = None
        rig.refill()
        conn = rig.tx.connect(rig.rx.address())
        conn.write(rig.src_region, rig.remote, big).wait(WAIT)
        assert_landed(rig.src, rig.dst, big)


def test_drop_peer_from_inside_the_notify_handler_does_not_deadlock(backend: Backend) -> None:
    with Rig(backend) as rig:
        need(rig.rx, "fence")
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


def test_no_notify_starts_after_drop_peer_returns(backend: Backend, monkeypatch) -> None:
    with Rig(backend) as rig:
        need(rig.rx, "fence")
        # held between "this transfer landed and its link is not fenced" and the handler call
        gate = StepGate(rig.rx.inbound.notify, when=lambda sender, payload: payload == b"fenced")
        monkeypatch.setattr(rig.rx.inbound, "notify", gate)
        whole = np.array([[0, 0, SRC_BYTES]], np.int64)
        handle = rig.conn.write(rig.src_region, rig.remote, whole, notify=b"fenced")
        drop_while_gated(rig, gate, FENCE_WAIT)
        assert gate.ran_after_fence is False, "a notify was handed to the handler after drop_peer returned"
        try:  # the bytes landed before the fence; whether the ack got out is backend timing
            handle.wait(WAIT)
        except PeerLostError:
            pass


def test_settled_once_a_closed_link_ended_here_and_only_on_proof(backend: Backend, monkeypatch) -> None:
    with Rig(backend) as rig:
        rx, sender = rig.rx, rig.tx.engine_id
        rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
        link = rig.conn.incarnation
        assert isinstance(link, str) and link, f"{backend}: its connection names no incarnation"
        assert not rx.settled(sender, link) and not rx.settled(sender), "an open link read as settled"
        assert rx.settled(sender, "never-seen") and rx.settled("nobody"), "nothing left to land there"
        proof = getattr(rx, "cut_settles", rx.capabilities.fence)
        if not proof:  # only the sender's word settles such a link: it says it could not drain
            monkeypatch.setattr(type(rig.conn), "drain", lambda self, deadline: False)
        rig.conn.close()
        assert until(lambda: not rx.has_peer(sender)), "the closed link never ended at the receiver"
        if proof:
            assert until(lambda: rx.settled(sender, link)), "an ended link never read as settled"
            assert rx.settled(sender)
        else:
            assert not rx.settled(sender, link) and not rx.settled(sender), (
                "a link the sender could not drain read as settled: its writes may still land")


def test_refuse_new_links_holds_a_sender_off_until_its_old_links_settled(backend: Backend) -> None:
    with Rig(backend) as rig:
        rx, sender = rig.rx, rig.tx.engine_id
        rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
        rx.refuse_new_links(sender)
        with pytest.raises(TransportError):
            rig.tx.open_link(rx.address()).close()  # a second link while the first is open
        assert rx.has_peer(sender), "the refusal touched the link that was already there"
        rig.conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
        rig.conn.close()
        assert until(lambda: rx.settled(sender)), "the closed link never settled"
        conn = rig.tx.connect(rx.address())  # its old links settled: the refusal lifted itself
        conn.write(rig.src_region, rig.remote, good_table()).wait(WAIT)
