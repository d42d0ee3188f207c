"""Kit cases: options refused, capabilities from one source, readiness waits in the post queue, close joins.

* An option the backend does not take is refused with `CapabilityError`
  naming it (never accepted and ignored), as is a common option of the
  wrong type.
* What the registry says a configuration can do is what an engine of it
  declares (`capabilities_for` is the one source).
* A write whose producer event is not reached waits in its link's post
  queue — `write()` returns at once, later writes on that link keep their
  order behind it, another link's writes go through meanwhile — and fails
  with `TransferTimeout` naming the fix if it is never reached. The event is
  a stand-in with `query()`, patched in where the kit captures `ready`.
* `close()` joins every thread the engine started.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from .. import link as link_module
from .. import registry
from ..errors import CapabilityError, TransferTimeout
from .rig import WAIT, Backend, Rig, good_table
from .tables import CANARY, assert_landed

# Options some backend takes: each is refused by every backend that does not.
KNOWN_OPTIONS = {"port": 0, "streams": 2, "max_pending": 8, "fence": True, "tls": "tcp",
                 "rails": 1, "copy_threads": 1, "bounce_bytes": 1 << 20}


def test_an_unknown_option_is_refused_naming_it(backend: Backend) -> None:
    with pytest.raises(CapabilityError, match=r"has no option 'no_such_option'; its options: "):
        backend.create(no_such_option=1)


def test_options_another_backend_takes_are_refused_not_ignored(backend: Backend) -> None:
    if backend.spawn is None:
        pytest.skip(f"{backend.label} is not in the registry: its option list is unknown")
    name, pinned = backend.spawn
    used, ignored = registry.options(name)
    for option, value in KNOWN_OPTIONS.items():
        if option in used or option in ignored or option in pinned:
            continue
        with pytest.raises(CapabilityError, match=f"has no option '{option}'|pins {option}="):
            backend.create(**{option: value})


@pytest.mark.parametrize("value", [-1.0, 0, float("nan"), float("inf"), "5", True])
def test_a_bad_connect_timeout_is_refused(backend: Backend, value: object) -> None:
    with pytest.raises(CapabilityError, match="connect_timeout must be a finite, positive number"):
        backend.create(connect_timeout=value)


def test_declared_capabilities_are_what_an_engine_reports(backend: Backend) -> None:
    with backend.create() as engine:
        if backend.declared is not None:
            assert backend.declared == engine.capabilities, (
                f"{backend.label}: the registry says {backend.declared}, an engine {engine.capabilities}")
        if backend.spawn is not None and not backend.spawn[1]:
            assert registry.capabilities(backend.spawn[0]) == engine.capabilities


class Producer:
    """Stands in for a producer's CUDA event: `query()` is all the post queue asks of it."""

    def __init__(self) -> None:
        self.reached, self.asked = threading.Event(), threading.Event()

    def query(self) -> bool:
        self.asked.set()
        return self.reached.is_set()


def _fake_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    real = link_module.capture
    monkeypatch.setattr(link_module, "capture",
                        lambda ready, device: ready if isinstance(ready, Producer) else real(ready, device))


def test_a_write_waits_in_its_links_queue_for_its_producer_and_keeps_order(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_capture(monkeypatch)
    with Rig(backend) as rig, backend.create() as other:
        side = np.full(1 << 16, CANARY, np.uint8)
        side_region = other.register(torch.from_numpy(side))
        side_link = rig.tx.connect(other.address())
        submitted: list[int] = []
        submit = rig.conn.submit
        monkeypatch.setattr(rig.conn, "submit", lambda post: (submitted.append(post.seq), submit(post)))
        producer = Producer()
        first = np.array([[0, 0, 4096]], np.int64)
        second = np.array([[4096, 4096, 4096]], np.int64)
        h1 = rig.conn.write(rig.src_region, rig.remote, first, notify=b"first", ready=producer)
        h2 = rig.conn.write(rig.src_region, rig.remote, second, notify=b"second")
        assert producer.asked.wait(WAIT), "nobody asked whether the producer's event was reached"
        # another link is not held up by this link's unready head
        side_table = np.array([[0, 0, 4096]], np.int64)
        side_link.write(rig.src_region, side_region.descriptor(), side_table).wait(WAIT)
        assert_landed(rig.src, side, side_table)
        producer.asked.clear()
        assert producer.asked.wait(WAIT)  # a later look, and still held
        assert submitted == [], "a write was posted while the head of its link waited"
        assert not h1.poll() and not h2.poll()
        assert (rig.dst[:8192] == CANARY).all(), "posted before its producer's event was reached"
        producer.reached.set()
        h1.wait(WAIT)
        h2.wait(WAIT)
        assert len(submitted) == 2 and submitted[0] < submitted[1], f"posted out of order: {submitted}"
        assert_landed(rig.src, rig.dst, np.concatenate([first, second]))
        rig.wait_note(b"first")
        rig.wait_note(b"second")


def test_a_producer_event_never_reached_fails_its_write_and_the_link_goes_on(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_capture(monkeypatch)
    with Rig(backend, connect_timeout=0.5) as rig:
        handle = rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"never",
                                ready=Producer())
        with pytest.raises(TransferTimeout, match=r"record `ready` after the work"):
            handle.wait(WAIT)
        table = np.array([[0, 2 << 20, 4096]], np.int64)
        rig.conn.write(rig.src_region, rig.remote, table, notify=b"after").wait(WAIT)
        assert_landed(rig.src, rig.dst, table)
        assert b"never" not in [p for _, p in rig.notes]


def _move_one(backend: Backend) -> None:
    a, b = backend.create(), backend.create()
    try:
        nbytes = 9 << 20  # over loopback's PARALLEL_MIN (8 MiB) in 64 rows: its copy helpers run
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        local, remote = a.register(src), b.register(dst)
        step = nbytes // 64
        table = np.stack([np.arange(64) * step, np.arange(64) * step, np.full(64, step)], 1)
        a.connect(b.address()).write(local, remote.descriptor(), table.astype(np.int64)).wait(WAIT * 3)
        assert bool(dst.all())
    finally:
        a.close()
        b.close()


def test_close_joins_every_thread_it_started(backend: Backend) -> None:
    _move_one(backend)  # once first: threads the process keeps (a NIC's) exist from here on
    before = set(threading.enumerate())
    _move_one(backend)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads still running after close(): {left}"
