"""`Capabilities.fence` and `has_peer`: what a receiver that cannot fence relies on (#11).

Every backend declares `fence` per instance and answers `has_peer` honestly:
True while a sender's link is open, False once the sender closed it. Loopback
and tcp can be told `fence=False` (the engine's no-fence path is tested on
them); their `drop_peer` then refuses instead of pretending, and the class's
capabilities — what other instances report — are untouched.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pdxfer.transport.errors import CapabilityError
from transport_rig import WAIT, Rig

from pdxfer import transport


def _until(cond, timeout: float = WAIT) -> bool:
    """Wait for `cond()` on an event that never fires: a bounded re-check, no fixed sleep."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        tick.wait(0.01)
    return cond()


def test_every_backend_declares_fence_and_tracks_its_peers(rig: Rig) -> None:
    assert isinstance(rig.rx.capabilities.fence, bool)
    sender = rig.tx.engine_id
    table = np.array([[0, 0, 4096]], dtype=np.int64)
    rig.conn.write(rig.src_region, rig.remote, table, notify=b"x").wait(WAIT)
    rig.wait_notes(1)
    assert rig.rx.has_peer(sender), "a sender whose link is open must count as present"
    assert not rig.rx.has_peer("no-such-engine")
    rig.tx.close()
    assert _until(lambda: not rig.rx.has_peer(sender)), (
        f"{rig.backend}: has_peer still True after the sender's engine closed"
    )


@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_fence_false_turns_the_fence_off_and_drop_peer_refuses(backend: str) -> None:
    with transport.create(backend, fence=False) as rx, transport.create(backend) as other:
        assert rx.capabilities.fence is False
        assert other.capabilities.fence is True, "fence=False leaked into other instances"
        assert type(rx).capabilities.fence is True
        with pytest.raises(CapabilityError, match=r"cannot fence a peer: it was created with fence=False"):
            rx.drop_peer(other.engine_id)
    with pytest.raises(CapabilityError, match=r"option fence must be True or False, got 'no'"):
        transport.create(backend, fence="no")


def test_nixl_fences_only_over_tcp() -> None:
    if "nixl" not in transport.available():
        pytest.skip("nixl-cu12 is not installed here")
    with transport.create("nixl") as fenced, transport.create("nixl", tls="all") as wide:
        assert fenced.capabilities.fence is True
        assert wide.capabilities.fence is False
        with pytest.raises(CapabilityError, match=r"cannot fence a peer"):
            wide.drop_peer(fenced.engine_id)
