"""The kit's rig: a backend factory, a connected pair of its engines, and the gates cases stall with.

`Backend` is what the kit is a function of: a label (the test id), a
factory `create(**options) -> TransportEngine`, and — if its peers may be
other processes — how a child process makes the same engine (`spawn`: a
registry name and options; `peer.py` runs it). `Rig` builds a sender and a
receiver of one backend, registers a random source and a canary-filled
destination, connects them and records notifications.

`Gate` (a notify handler that blocks on one payload) and `StepGate` (wraps
any step so its first call waits) make "mid-transfer" deterministic instead
of a race against a fast copy; `until` re-checks a predicate on a bounded
wait, for state no event announces.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from ..base import Capabilities, TransportEngine
from ..wire import LENGTH
from .forked import ForkedProcess
from .tables import CANARY, assert_landed

SRC_BYTES = 4 << 20
DST_BYTES = 8 << 20
WAIT = 20.0  # generous: the machine running the suite may be loaded


@dataclass(frozen=True)
class Backend:
    """One backend configuration the kit runs over."""

    label: str
    create: Callable[..., TransportEngine]
    # (registry name, options): how a peer process builds the same engine; None if it cannot
    spawn: tuple[str, dict[str, Any]] | None = None
    # what its engines declare, if known without building one (the registry's capabilities_for)
    declared: Capabilities | None = None

    def __str__(self) -> str:
        return self.label

    @classmethod
    def named(cls, name: str, **options: Any) -> Backend:
        """The registry's backend or variant `name`, configured by `options`, as a kit backend."""
        from .. import registry

        def create(**extra: Any) -> TransportEngine:
            return registry.create(name, **options, **extra)

        return cls(name, create, (name, dict(options)))

    def capabilities(self) -> Capabilities:
        """What this backend's engines declare (an engine is built and closed if not given)."""
        if self.declared is not None:
            return self.declared
        with self.create() as engine:
            return engine.capabilities


class Rig:
    """A connected sender/receiver pair of one backend, with buffers and a notify log."""

    def __init__(self, backend: Backend, **options: Any) -> None:
        self.backend = backend
        rng = np.random.default_rng(7)
        self.tx = backend.create(**options)
        try:
            self.rx = backend.create(**options)
        except BaseException:
            self.tx.close()
            raise
        try:
            self.src = rng.integers(0, 256, SRC_BYTES, dtype=np.uint8)
            self.dst = np.full(DST_BYTES, CANARY, dtype=np.uint8)
            self.src_region = self.tx.register(torch.from_numpy(self.src))
            self.dst_region = self.rx.register(torch.from_numpy(self.dst))
            self.remote = self.dst_region.descriptor()
            self.notes: list[tuple[str, bytes]] = []
            self.noted = threading.Condition()
            # Cases swap this to look at memory at the moment a notify arrives.
            self.on_notify: Callable[[str, bytes], None] | None = None
            self.rx.set_notify_handler(self._notify)
            self.conn = self.tx.connect(self.rx.address())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    @property
    def healthy(self) -> bool:
        """Both engines open and the link alive: the rig can serve another case as it is."""
        return not self.tx.closed and not self.rx.closed and getattr(self.conn, "alive", False)

    def reset(self) -> Rig:
        """Canary back in the destination, no notes, no handler hook: as a fresh rig starts."""
        self.on_notify = None
        self.refill()
        with self.noted:
            self.notes.clear()
        return self

    def close(self) -> None:
        self.tx.close()
        rx = getattr(self, "rx", None)
        if rx is not None:
            rx.close()


class RigPool:
    """One rig per backend shared by the cases that leave it as they found it (a test module's).

    Building a rig costs two engines and a dial (for nixl, three NIXL agents); the
    refusal and round-trip cases, dozens per backend, reuse one instead. A rig a case
    broke (a closed engine, a dead link) is replaced before the next one gets it.
    """

    def __init__(self) -> None:
        self._rigs: dict[str, Rig] = {}

    def get(self, backend: Backend) -> Rig:
        rig = self._rigs.get(backend.label)
        if rig is not None and not rig.healthy:
            rig.close()
            rig = None
        if rig is None:
            rig = self._rigs[backend.label] = Rig(backend)
        return rig.reset()

    def close(self) -> None:
        for rig in self._rigs.values():
            rig.close()
        self._rigs.clear()


class Gate:
    """A notify handler that blocks on the first payload it sees: stalls the peer on purpose.

    Blocking a notify handler stalls the receiving side of the link it arrived
    on. Always `release()` it (the rig's close does not).
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


class StepGate:
    """Wraps a function: its first call (matching `when`) stops at the gate until `open()`."""

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


class Trickler:
    """A fake peer for dials: accepts, reads the hello frame, then announces a 1000-byte welcome
    and sends it one byte every `every` s (or stays silent), until the dialer hangs up.
    """

    def __init__(self, every: float, silent: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.every, self.silent = every, silent
        self.accepted, self.hung_up, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.server.settimeout(WAIT * 3)
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        self.accepted.set()
        with conn:
            try:
                head = conn.recv(4, socket.MSG_WAITALL)
                if len(head) == 4:  # else the dialer gave up (its engine closed) before its hello
                    conn.recv(LENGTH.unpack(head)[0], socket.MSG_WAITALL)
                    if not self.silent:
                        conn.sendall(LENGTH.pack(1000))  # a welcome "is coming"... a byte at a time
                conn.settimeout(self.every)
                while not self.stop.is_set():
                    try:
                        if not conn.recv(1):
                            break  # the dialer hung up
                    except TimeoutError:
                        if not self.silent:
                            conn.sendall(b"\x00")
            except OSError:
                pass
        self.hung_up.set()

    def address(self, backend: str) -> dict[str, Any]:
        """An address of `backend` that leads here."""
        return {"backend": backend, "engine": f"{backend}-trickler", "host": "127.0.0.1",
                "port": self.port}

    def close(self) -> None:
        self.stop.set()
        self.server.close()
        self.thread.join(WAIT)


def drop_while_gated(rig: Rig, gate: StepGate, fence_wait: float) -> np.ndarray:
    """`drop_peer` on the receiver while `gate` holds its step; the destination as it returned.

    A correct fence blocks until the gate opens (so the step ends before it
    returns); a broken one returns within `fence_wait`, with the step still
    held, and the step then runs after it (`gate.ran_after_fence`).
    """
    assert gate.entered.wait(WAIT), "the gated step never ran"
    snapshot: list[np.ndarray] = []

    def drop() -> None:
        rig.rx.drop_peer(rig.tx.engine_id)
        gate.fence_done.set()
        snapshot.append(rig.dst.copy())

    dropper = threading.Thread(target=drop)
    dropper.start()
    dropper.join(fence_wait)  # a broken fence returns here, with the step still held
    gate.open()
    dropper.join(WAIT)
    assert not dropper.is_alive(), "drop_peer never returned"
    assert gate.finished.wait(WAIT)
    return snapshot[0]


def need(subject: TransportEngine | Backend, flag: str, why: str = "") -> None:
    """Skip the calling case unless the engine's (or backend's) capability `flag` is True.

    The reason names the flag: a skip is decided only by what was declared.
    """
    if isinstance(subject, Backend):
        caps, who = subject.capabilities(), subject.label
    else:
        caps, who = subject.capabilities, f"{subject.name} engine"
    if not getattr(caps, flag):
        pytest.skip(f"capability {flag}=False ({who})" + (f": {why}" if why else ""))


def until(cond: Callable[[], bool], timeout: float = WAIT, step: float = 0.01) -> bool:
    """Re-check `cond` on a bounded wait (for state no event announces); its last answer."""
    tick = threading.Event()
    for _ in range(int(timeout / step)):
        if cond():
            return True
        tick.wait(step)
    return cond()


# -- tables the cases share ----------------------------------------------------------

def good_table() -> np.ndarray:
    """One good row: it would land if a backend moved rows before checking them all."""
    return np.array([[0, 1000, 5000]], np.int64)


def with_row(row: list[int]) -> np.ndarray:
    return np.concatenate([good_table(), np.array([row], np.int64)])


def assert_untouched_then_usable(rig: Rig) -> None:
    """Nothing of a refused write landed, and the link still moves a good one."""
    good = np.array([[0, 2 << 20, 4096]], np.int64)
    rig.conn.write(rig.src_region, rig.remote, good, notify=b"good").wait(WAIT)
    assert_landed(rig.src, rig.dst, good)  # ... and every byte outside it, incl. the bad rows', is canary
    rig.wait_note(b"good")
    assert b"bad" not in [p for _, p in rig.notes]


# -- a peer in another process ----------------------------------------------------------

class PeerProcess:
    """An engine of `backend` in a child process (`peer.py`), with one registered buffer."""

    def __init__(self, backend: Backend, nbytes: int) -> None:
        assert backend.spawn is not None
        name, options = backend.spawn
        # Forked from a server that imported torch once (`forked`): seconds less per peer.
        self.child = ForkedProcess(module="pdxfer.transport.testing.peer", text=False,
                                   args=[name, msgpack.packb(options).hex(), str(nbytes)])
        ready, _, _ = select.select([self.child.stdout], [], [], 60)
        line = self.child.stdout.readline() if ready else b""
        if not line:
            self.kill()
            raise AssertionError(f"peer process did not start (exit code {self.child.poll()})")
        info = msgpack.unpackb(bytes.fromhex(line.decode()))
        self.address, self.descriptor = info["address"], info["descriptor"]
        self.pid = self.child.pid

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP, and return once every thread of it is stopped (signals land asynchronously)."""
        self.child.freeze(WAIT)

    def kill(self) -> None:
        self.child.kill()
        self.child.wait()


class PeerPool:
    """One peer process per backend, shared by a module's cases (each costs seconds to start).

    `get` keeps it for the next case (a case that froze it resumes it); `take` hands it
    over for good (a case that kills it).
    """

    NBYTES = 64 << 20

    def __init__(self) -> None:
        self._peers: dict[str, PeerProcess] = {}

    def get(self, backend: Backend) -> PeerProcess:
        peer = self._peers.get(backend.label)
        if peer is None or peer.child.poll() is not None:
            peer = self._peers[backend.label] = PeerProcess(backend, self.NBYTES)
        return peer

    def take(self, backend: Backend) -> PeerProcess:
        peer = self.get(backend)
        del self._peers[backend.label]
        return peer

    def close(self) -> None:
        for peer in self._peers.values():
            peer.kill()
        self._peers.clear()
