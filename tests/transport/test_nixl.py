"""What only the nixl backend has: its metadata refresh, its fence configuration, its frames.

Everything in the transport contract is pinned by the conformance suite,
which runs over nixl because it is in `transport.available()`; these tests
cover the mechanisms nixl adds to meet it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError, ProtocolError, RegistrationError, TransportError
from segment_tables import CANARY, assert_landed
from transport_rig import WAIT, Rig

from pdxfer import transport

pytestmark = pytest.mark.skipif(
    "nixl" not in transport.available(), reason="nixl-cu12 is not installed (pip install nixl-cu12)"
)


@pytest.fixture
def rig():
    r = Rig("nixl")
    try:
        yield r
    finally:
        r.close()


def test_region_registered_after_connecting_is_reachable(rig: Rig) -> None:
    # The link's metadata predates this region: the write must refresh it, not fail.
    late = np.full(1 << 16, CANARY, dtype=np.uint8)
    region = rig.rx.register(torch.from_numpy(late))
    table = np.array([[0, 100, 5000], [9000, 30_000, 20_000]], np.int64)
    rig.conn.write(rig.src_region, region.descriptor(), table, notify=b"late").wait(WAIT)
    assert_landed(rig.src, late, table)
    rig.wait_note(b"late")
    # ... and the old region still works on the refreshed link.
    good = np.array([[0, 0, 4096]], np.int64)
    rig.conn.write(rig.src_region, rig.remote, good).wait(WAIT)
    assert_landed(rig.src, rig.dst, good)


def test_deregistered_region_is_refused_once_the_sender_hears(rig: Rig) -> None:
    extra = torch.zeros(4096, dtype=torch.uint8)
    region = rig.rx.register(extra)
    desc = region.descriptor()
    rig.conn.write(rig.src_region, desc, np.array([[0, 0, 16]], np.int64)).wait(WAIT)
    rig.rx.deregister(region)
    rig.rx.deregister(region)  # idempotent
    deadline = time.monotonic() + WAIT
    while True:  # `Gone` travels asynchronously on the control connection
        try:
            rig.conn.write(rig.src_region, desc, np.array([[0, 0, 16]], np.int64)).wait(WAIT)
        except RegistrationError as exc:
            assert f"no region {desc['region']}" in str(exc)
            break
        assert time.monotonic() < deadline, "the sender never heard the region was deregistered"
        time.sleep(0.01)


def test_close_fences_the_link_on_the_receiver(rig: Rig) -> None:
    rig.conn.write(rig.src_region, rig.remote, np.array([[0, 0, 64]], np.int64)).wait(WAIT)
    assert [p.sender for p in rig.rx._live_peers()] == [rig.tx.engine_id]
    rig.conn.close()
    deadline = time.monotonic() + WAIT
    while rig.rx._live_peers():  # the receiver's fence follows our Bye
        assert time.monotonic() < deadline, "receiver kept the closed link's agent"
        time.sleep(0.01)


def test_transports_that_cannot_be_fenced_make_drop_peer_refuse() -> None:
    with transport.create("nixl", tls="tcp,cma") as engine:
        with pytest.raises(CapabilityError, match="cannot fence a peer.*use tls='tcp'"):
            engine.drop_peer("nixl-someone")


def test_unknown_ucx_transport_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match="cannot start a NIXL agent with UCX transports 'bogus'"):
        transport.create("nixl", tls="bogus")


def test_notification_frames_round_trip_and_refuse_garbage() -> None:
    from pdxfer.transport.nixl_wire import pack_note, unpack_note

    note = unpack_note(pack_note(7, b"payload"))
    assert (note.seq, note.payload) == (7, b"payload")
    assert unpack_note(pack_note(8, None)).payload is None
    with pytest.raises(ProtocolError, match="undecodable"):
        unpack_note(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack_note(b"x" * (200 * 1024))
