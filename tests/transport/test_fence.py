"""The fence reached for real inside a backend's landing path: a copy or a payload read in progress.

Issue #9 item 7. The kit proves the notify half on every backend
(`cases_fence.test_no_notify_starts_after_drop_peer_returns`); these hold
the *bytes* at a gate inside the receiving path of the backends that land
them on our CPU — loopback's copy, tcp's payload read (with megabytes still
queued in the socket) — start `drop_peer` on another thread, and check the
promise: when it returns, no byte of the dropped peer changes any more.
(verbs' version, a packet held on the software NIC, is in
test_verbs_backend.py.)

How the gate proves it: `drop_peer` runs while the gated step cannot finish.
A correct fence blocks until the gate opens (so the step ends before it
returns); a broken one returns at once, and the step then lands after it.
"""

from __future__ import annotations

import numpy as np
import pytest
from pdxfer.transport import loopback
from pdxfer.transport.errors import PeerLostError
from pdxfer.transport.tcp import recv as tcp_recv
from pdxfer.transport.testing import Backend, Rig, StepGate
from pdxfer.transport.testing.rig import SRC_BYTES, WAIT, drop_while_gated

FENCE_WAIT = 1.0


WHOLE = np.array([[0, 0, SRC_BYTES]], np.int64)


def test_loopback_drop_peer_waits_out_a_copy_in_progress(monkeypatch) -> None:
    with Rig(Backend.named("loopback")) as rig:
        gate = StepGate(loopback.move)
        monkeypatch.setattr(loopback, "move", gate)
        handle = rig.conn.write(rig.src_region, rig.remote, WHOLE, notify=b"late")
        at_return = drop_while_gated(rig, gate, FENCE_WAIT)
        assert not gate.ran_after_fence, "the copy started after drop_peer returned"
        assert np.array_equal(rig.dst, at_return), "bytes landed after drop_peer returned"
        with pytest.raises(PeerLostError):  # its notify may not start after the fence: not confirmed
            handle.wait(WAIT)
        assert b"late" not in [p for _, p in rig.notes]


@pytest.mark.parametrize("step", [
    # held at the payload read of the first header, with its megabytes queued in the socket:
    # the fence must wait for the read (the kit's guard)
    "recv_all",
    # held after the header's check, before the guard: the fence finds the guard free
    # and returns; the stream must then see `dead` and read nothing of the queued payload
    "check_ranges",
])
def test_tcp_no_byte_lands_after_drop_peer_returns(monkeypatch, step: str) -> None:
    with Rig(Backend.named("tcp")) as rig:
        gate = StepGate(getattr(tcp_recv, step))
        monkeypatch.setattr(tcp_recv, step, gate)
        handle = rig.conn.write(rig.src_region, rig.remote, WHOLE, notify=b"late")
        at_return = drop_while_gated(rig, gate, FENCE_WAIT)
        assert np.array_equal(rig.dst, at_return), "bytes landed after drop_peer returned"
        with pytest.raises(PeerLostError):
            handle.wait(WAIT)
        assert b"late" not in [p for _, p in rig.notes]
