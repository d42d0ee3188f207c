"""The conformance rig: two engines of one backend, buffers, a notify log; and `Gate`.

Lives in a module of its own, not in conftest.py, so test modules import it
by a name no other test directory uses. `Rig` builds a sender and a receiver
engine of one backend, registers a random source buffer and a canary-filled
destination, connects them and records notifications; `OPTIONS` pins backend
options that would otherwise depend on the machine (tcp's stream count
follows the core count).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from segment_tables import CANARY, assert_landed

from pdxfer import transport

OPTIONS: dict[str, dict] = {"tcp": {"streams": 2}}
SRC_BYTES = 4 << 20
DST_BYTES = 8 << 20
WAIT = 20.0  # generous: the machine running the suite may be loaded


def can_fence(engine: transport.TransportEngine) -> bool:
    """Whether `engine.drop_peer` is a fence: its `capabilities.fence` (per instance)."""
    return engine.capabilities.fence


def needs_fence(rig: Rig) -> None:
    """Skip, with the reason, a test whose subject is the fence on a backend that has none."""
    if not can_fence(rig.rx):
        pytest.skip(f"{rig.backend} cannot fence a peer (one-sided UCX transports); "
                    "test_drop_peer_is_a_fence_or_refuses pins its refusal")


class Rig:
    """A connected sender/receiver pair of one backend, with buffers and a notify log."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        rng = np.random.default_rng(7)
        self.tx = transport.create(backend, **OPTIONS.get(backend, {}))
        self.rx = transport.create(backend, **OPTIONS.get(backend, {}))
        self.src = rng.integers(0, 256, SRC_BYTES, dtype=np.uint8)
        self.dst = np.full(DST_BYTES, CANARY, dtype=np.uint8)
        self.src_region = self.tx.register(torch.from_numpy(self.src))
        self.dst_region = self.rx.register(torch.from_numpy(self.dst))
        self.remote = self.dst_region.descriptor()
        self.notes: list[tuple[str, bytes]] = []
        self.noted = threading.Condition()
        # Tests swap this to look at memory at the moment a notify arrives.
        self.on_notify: Callable[[str, bytes], None] | None = None
        self.rx.set_notify_handler(self._notify)
        self.conn = self.tx.connect(self.rx.address())

    def _notify(self, sender: str, payload: bytes) -> None:
        if self.on_notify is not None:
            self.on_notify(sender, payload)
        with self.noted:
            self.notes.append((sender, payload))
            self.noted.notify_all()

    def wait_notes(self, count: int, timeout: float = WAIT) -> list[tuple[str, bytes]]:
        with self.noted:
            assert self.noted.wait_for(lambda: len(self.notes) >= count, timeout), (
                f"{len(self.notes)}/{count} notifications after {timeout} s"
            )
            return list(self.notes)

    def wait_note(self, payload: bytes, timeout: float = WAIT) -> None:
        """Wait until `payload` arrived from the sender (other notes may arrive too)."""
        want = (self.tx.engine_id, payload)
        with self.noted:
            assert self.noted.wait_for(lambda: want in self.notes, timeout), (
                f"no notify {payload!r} after {timeout} s; got {self.notes}"
            )

    def refill(self) -> None:
        self.dst[:] = CANARY

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


class Gate:
    """A notify handler that blocks on the first payload it sees: stalls the peer on purpose.

    Blocking a notify handler stalls the receiving side of the stream it
    arrived on — which makes "mid-transfer" deterministic instead of a race
    against a fast copy. Always `release()` it (the fixture's close does not).
    """

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, sender: str, payload: bytes) -> None:
        if payload == self.payload:
            self.entered.set()
            self.released.wait(30)

    def release(self) -> None:
        self.released.set()


# Helpers the conformance files share.
def good_table() -> np.ndarray:
    """One good row: it would land if a backend moved rows before checking them all."""
    # A row that would land if a backend moved rows before checking them all.
    return np.array([[0, 1000, 5000]], np.int64)


def with_row(row: list[int]) -> np.ndarray:
    return np.concatenate([good_table(), np.array([row], np.int64)])


def assert_untouched_then_usable(rig: Rig) -> None:
    good = np.array([[0, 2 << 20, 4096]], np.int64)
    rig.conn.write(rig.src_region, rig.remote, good, notify=b"good").wait(WAIT)
    assert_landed(rig.src, rig.dst, good)  # ... and every byte outside it, incl. the bad rows', is canary
    rig.wait_note(b"good")
    assert b"bad" not in [p for _, p in rig.notes]
