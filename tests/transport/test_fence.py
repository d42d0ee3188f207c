"""The fence, reached for real: a copy and a notify provably in progress when `drop_peer` runs.

Issue #9 item 7. Each test holds the receiving path at a gate *inside* it —
loopback's copy, tcp's payload read (with megabytes still queued in the
socket), the notify hand-off of every backend — starts `drop_peer` on another
thread, and checks the promise: when `drop_peer` returns, no byte of the
dropped peer changes any more and no notify of it starts.

How the gate proves it: `drop_peer` runs while the gated step cannot finish.
A correct fence blocks until the gate opens (so the step ends before it
returns); a broken one returns at once, and the step then lands after it.
The test waits `FENCE_WAIT` seconds for a broken fence to return — never a
sleep: a correct fence passes whatever that wait is, a broken one returns
within microseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pdxfer.transport import tcp_recv
from pdxfer.transport.errors import PeerLostError
from transport_rig import WAIT, Rig

from pdxfer import transport

FENCE_WAIT = 2.0


class StepGate:
    """Wraps a function: its first call stops at the gate until `open()`; later calls pass."""

    def __init__(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a: True) -> None:
        self.fn, self.when = fn, when
        self.entered, self.opened, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.fence_done = threading.Event()
        self.ran_after_fence: bool | None = None
        self._used = False
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            mine = not self._used and self.when(*args)
            self._used = self._used or mine
        if not mine:
            return self.fn(*args, **kwargs)
        self.entered.set()
        self.opened.wait(WAIT)
        self.ran_after_fence = self.fence_done.is_set()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.finished.set()

    def open(self) -> None:
        self.opened.set()


def _drop_while_gated(rig: Rig, gate: StepGate) -> np.ndarray:
    """drop_peer on the receiver while `gate` holds its step; the destination as it returned."""
    assert gate.entered.wait(WAIT), "the gated step never ran"
    snapshot: list[np.ndarray] = []

    def drop() -> None:
        rig.rx.drop_peer(rig.tx.engine_id)
        gate.fence_done.set()
        snapshot.append(rig.dst.copy())

    dropper = threading.Thread(target=drop)
    dropper.start()
    dropper.join(FENCE_WAIT)  # a broken fence returns here, with the step still held
    gate.open()
    dropper.join(WAIT)
    assert not dropper.is_alive(), "drop_peer never returned"
    assert gate.finished.wait(WAIT)
    return snapshot[0]


def _whole_src() -> np.ndarray:
    from transport_rig import SRC_BYTES
    return np.array([[0, 0, SRC_BYTES]], np.int64)


@pytest.fixture
def rig_of(request: pytest.FixtureRequest):
    rigs: list[Rig] = []

    def make(backend: str) -> Rig:
        if backend not in transport.available():
            pytest.skip(f"backend {backend} is not installed here")
        rigs.append(Rig(backend))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def test_loopback_drop_peer_waits_out_a_copy_in_progress(rig_of, monkeypatch) -> None:
    rig = rig_of("loopback")
    gate = StepGate(rig.tx._move)
    monkeypatch.setattr(rig.tx, "_move", gate)
    handle = rig.conn.write(rig.src_region, rig.remote, _whole_src(), notify=b"late")
    at_return = _drop_while_gated(rig, gate)
    assert not gate.ran_after_fence, "the copy started after drop_peer returned"
    assert np.array_equal(rig.dst, at_return), "bytes landed after drop_peer returned"
    with pytest.raises(PeerLostError):  # its notify may not start after the fence: not confirmed
        handle.wait(WAIT)
    assert b"late" not in [p for _, p in rig.notes]


@pytest.mark.parametrize("step", [
    # held at the payload read of the first header, with its megabytes queued in the socket:
    # the fence must wait for the read (the landing lock)
    "recv_all",
    # held after the header's check, before the landing lock: the fence finds the lock free
    # and returns; the stream must then see `dropped` and read nothing of the queued payload
    "check_ranges",
])
def test_tcp_no_byte_lands_after_drop_peer_returns(rig_of, monkeypatch, step: str) -> None:
    rig = rig_of("tcp")
    gate = StepGate(getattr(tcp_recv, step))
    monkeypatch.setattr(tcp_recv, step, gate)
    handle = rig.conn.write(rig.src_region, rig.remote, _whole_src(), notify=b"late")
    at_return = _drop_while_gated(rig, gate)
    assert np.array_equal(rig.dst, at_return), "bytes landed after drop_peer returned"
    with pytest.raises(PeerLostError):
        handle.wait(WAIT)
    assert b"late" not in [p for _, p in rig.notes]


@pytest.mark.parametrize("backend", ["loopback", "tcp", "nixl"])
def test_no_notify_starts_after_drop_peer_returns(rig_of, monkeypatch, backend: str) -> None:
    rig = rig_of(backend)
    # held between "this transfer landed and its link is not dropped" and the handler call
    gate = StepGate(rig.rx._deliver, when=lambda sender, payload: payload == b"fenced")
    monkeypatch.setattr(rig.rx, "_deliver", gate)
    handle = rig.conn.write(rig.src_region, rig.remote, _whole_src(), notify=b"fenced")
    _drop_while_gated(rig, gate)
    assert gate.ran_after_fence is False, "a notify was handed to the handler after drop_peer returned"
    try:  # the bytes landed before the fence; whether the ack got out is backend timing
        handle.wait(WAIT)
    except PeerLostError:
        pass

