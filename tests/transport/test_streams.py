"""The stream contract (`transport.streams`) and the bounce pool's allocation time.

What runs here without a GPU: the refusals (readiness for host memory),
host copies through `CopyStream`, when tcp allocates its bounce slots, and a
guard that no device-wide synchronise is back on the data path. (How an
unready producer waits in its link's post queue is a kit case, driven by a
stand-in with `query()`: `transport/testing/cases_engine.py`.) The CUDA halves — a producer on a side stream handing over an event —
run where a GPU is, and skip here with the reason.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError
from pdxfer.transport.streams import CopyStream, capture
from pdxfer.transport.testing.tables import CANARY, assert_landed, random_table

from pdxfer import transport

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine")


def test_host_memory_takes_no_readiness() -> None:
    assert capture(None, "cpu") is None
    with pytest.raises(CapabilityError, match="applies to CUDA memory only"):
        capture(object(), torch.device("cpu"))


def test_copy_stream_runs_host_copies_now() -> None:
    out: list[int] = []
    CopyStream().run(torch.device("cpu"), None, lambda: out.append(1))
    assert out == [1]


def test_no_device_wide_synchronize_on_the_data_path() -> None:
    # The data path waits on exactly the producer's event and its own copy
    # stream; `torch.cuda.synchronize` would wait for the model's forward too.
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for pkg in ("transport", "pdxfer")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"cuda\.synchronize\(", line)
    ]
    assert offenders == []


def _engines(**opts: object) -> tuple[transport.TransportEngine, transport.TransportEngine]:
    return transport.create("tcp", streams=2, **opts), transport.create("tcp", streams=2, **opts)


def test_bounce_slots_are_allocated_at_connect_and_accept_not_in_a_transfer() -> None:
    tx, rx = _engines(force_bounce=True, bounce_bytes=64 << 10)
    try:
        src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.full(2 << 20, CANARY, dtype=np.uint8)
        s, d = tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))
        conn = tx.connect(rx.address())
        rx.inbound.links()  # accepted: both streams made their landing share
        # two sending slots here, two landing slots there, before any write
        assert tx.bounces.send.count == 2 and rx.bounces.recv.count == 2
        before = (tx.bounces.allocated_bytes, rx.bounces.allocated_bytes)
        table = random_table(np.random.default_rng(2), src.size, dst.size, 30, 100_000)
        conn.write(s, d.descriptor(), table).wait(20)
        assert_landed(src, dst, table)
        assert (tx.bounces.allocated_bytes, rx.bounces.allocated_bytes) == before
    finally:
        tx.close()
        rx.close()


def test_host_only_engines_pin_nothing() -> None:
    tx, rx = _engines()
    try:
        src = np.zeros(1 << 16, dtype=np.uint8)
        dst = np.full(1 << 16, CANARY, dtype=np.uint8)
        s, d = tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))
        tx.connect(rx.address()).write(s, d.descriptor(), np.array([[0, 0, 100]])).wait(20)
        assert tx.bounces.allocated_bytes == rx.bounces.allocated_bytes == 0
    finally:
        tx.close()
        rx.close()


@NO_CUDA
def test_registering_cuda_memory_pins_every_stream_at_once() -> None:
    tx, rx = _engines()
    try:
        tx.connect(rx.address())
        assert tx.bounces.allocated_bytes == 0
        tx.register(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        assert tx.bounces.send.count == 2 and tx.bounces.pinned
    finally:
        tx.close()
        rx.close()


@NO_CUDA
@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_a_side_stream_producer_hands_over_an_event(backend: str) -> None:
    # The producer fills the source on its own stream after a long kernel;
    # without waiting on `ready` the copy would ship the stale zeros.
    with transport.create(backend) as tx, transport.create(backend) as rx:
        src = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.full((8 << 20,), CANARY, dtype=torch.uint8, device="cuda")
        s, d = tx.register(src), rx.register(dst)
        conn = tx.connect(rx.address())
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the bytes are written
            src.fill_(7)
            ready = torch.cuda.Event()
            ready.record(side)
        table = random_table(np.random.default_rng(3), src.numel(), dst.numel(), 200, 20_000)
        landed = threading.Event()
        rx.set_notify_handler(lambda *_: landed.set())
        conn.write(s, d.descriptor(), table, notify=b"x", ready=ready).wait(30)
        assert landed.is_set()
        assert_landed(src.cpu().numpy(), dst.cpu().numpy(), table)  # Success: visible, no extra wait


class _Event:
    """Stands in for the CUDA event `capture` returns: already reached; its identity is what is checked."""

    def query(self) -> bool:
        return True


def test_the_event_captured_in_write_reaches_the_copy_on_the_io_thread(monkeypatch) -> None:
    # The plumbing a GPU needs, on the host: tcp's bounce path (force_bounce)
    # is the CUDA path's code; `capture` is what turns `ready` into an event
    # on the caller's thread, and the copy must wait on exactly that one.
    from pdxfer.transport import link
    from pdxfer.transport.tcp import bounce as tcp_bounce

    event, seen = _Event(), []
    monkeypatch.setattr(link, "capture", lambda ready, device: event if ready == "R" else None)
    gather = tcp_bounce.Bounce.gather
    monkeypatch.setattr(tcp_bounce.Bounce, "gather", lambda self, buf, src, rows, column, ready=None: (
        seen.append((ready, threading.current_thread().name)), gather(self, buf, src, rows, column))[1])
    tx, rx = _engines(force_bounce=True, bounce_bytes=64 << 10)
    try:
        src = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.full(1 << 20, CANARY, dtype=np.uint8)
        s, d = tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))
        table = random_table(np.random.default_rng(5), src.size, dst.size, 20, 30_000)
        tx.connect(rx.address()).write(s, d.descriptor(), table, ready="R").wait(20)
        assert_landed(src, dst, table)
    finally:
        tx.close()
        rx.close()
    assert seen and all(ready is event for ready, _ in seen)
    assert all(name.startswith("tcp-send") for _, name in seen)  # waited on where it copies


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices; this machine has none")
def test_loopback_refuses_copies_between_two_cuda_devices() -> None:
    with transport.create("loopback") as tx, transport.create("loopback") as rx:
        s = tx.register(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
        d = rx.register(torch.zeros(4096, dtype=torch.uint8, device="cuda:1"))
        with pytest.raises(CapabilityError, match="between two CUDA devices"):
            tx.connect(rx.address()).write(s, d.descriptor(), np.array([[0, 0, 16]]))
