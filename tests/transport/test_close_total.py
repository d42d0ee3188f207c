"""`close()` is total, retryable and bounded by one deadline whatever the number of peers (#29 item 4).

* total: a step that raises does not skip the ones after it — the engine's
  regions are deregistered and its links closed anyway — and the failures
  come back once, as one `CloseError` naming each step;
* retryable: a second `close()` after a failed one runs the steps that did
  not finish (and only those), so it can complete the close;
* one deadline: the links' goodbyes run at once, so fifty stalled peers (one
  SIGSTOPped process holding fifty engines whose sockets nobody reads) cost
  one `BYE_WAIT`, not fifty of them in turn (50 s on nixl and ucx before).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from pdxfer.transport import CloseError
from pdxfer.transport.testing.forked import ForkedProcess
from pdxfer.transport.testing.rig import WAIT

from pdxfer import transport

HERE = Path(__file__).resolve().parent
ROW = np.array([[0, 0, 4096]], np.int64)


def pair(backend: str = "tcp") -> tuple:
    rx = transport.create(backend, connect_timeout=5.0)
    tx = transport.create(backend, connect_timeout=5.0)
    dst = rx.register(torch.zeros(1 << 16, dtype=torch.uint8))
    src = tx.register(torch.ones(1 << 16, dtype=torch.uint8))
    conn = tx.connect(rx.address())
    conn.write(src, dst.descriptor(), ROW).wait(WAIT)
    return tx, rx, src, dst, conn


class Once:
    """Raise `RuntimeError` on the first call, then do what the wrapped call did."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected failure")
        return self.fn(*args, **kwargs)


def test_a_raising_step_skips_nothing_and_a_second_close_finishes() -> None:
    tx, rx, src, _, conn = pair()
    try:
        tx.readiness.close = Once(tx.readiness.close)  # an early step of the kit's close order
        with pytest.raises(CloseError, match=r"1 step\(s\) failed \(stop the readiness thread: "
                                             r"RuntimeError: injected failure\)") as info:
            tx.close()
        assert isinstance(info.value.__cause__, RuntimeError)
        assert [step for step, _ in info.value.failures] == ["stop the readiness thread"]
        # Every later step ran anyway: the link is closed, the regions deregistered.
        assert conn.dead and not tx.outbound.links()
        assert not src.registered and not tx.regions.live()
        # The second close retries the failed step, and only it.
        tx.close()
        assert tx.readiness.close.calls == 2
        assert tx._closing.finished
        tx.close()  # idempotent from here
        assert tx.readiness.close.calls == 2
    finally:
        rx.close()


def test_an_inbound_fence_that_raises_leaves_the_other_links_fenced_and_is_retried() -> None:
    tx1, rx, _, dst, _ = pair()
    tx2 = transport.create("tcp", connect_timeout=5.0)
    src2 = tx2.register(torch.ones(1 << 16, dtype=torch.uint8))
    tx2.connect(rx.address()).write(src2, dst.descriptor(), ROW).wait(WAIT)
    try:
        bad = rx.inbound.of(tx1.engine_id)[0]
        bad.cut = Once(bad.cut)
        with pytest.raises(CloseError, match=rf"fence inbound links: CloseError: closing tcp inbound "
                                             rf"links: 1 step\(s\) failed \(link from {tx1.engine_id}"):
            rx.close()
        assert not rx.has_peer(tx2.engine_id)  # the other sender's link was fenced anyway
        assert not dst.registered  # ... and the steps after the fence ran
        rx.close()
        assert not rx.has_peer(tx1.engine_id) and bad.cut.calls == 2
    finally:
        tx1.close()
        tx2.close()


class Frozen:
    """`count` engines of `backend` in one child process (many_peers.py), frozen on demand."""

    def __init__(self, backend: str, count: int) -> None:
        # forked from the preloaded server (transport.testing.forked): seconds less to start
        self.child = ForkedProcess(script=str(HERE / "many_peers.py"), args=[backend, str(count)],
                                   text=False)
        line = self.child.stdout.readline()
        assert line, f"many_peers.py exited with {self.child.wait()}"
        self.peers = msgpack.unpackb(bytes.fromhex(line.decode()))

    def freeze(self) -> None:
        self.child.freeze(WAIT)

    def kill(self) -> None:
        os.kill(self.child.pid, signal.SIGCONT)
        self.child.kill()
        self.child.wait()


@pytest.mark.parametrize("backend", ["tcp", "nixl", "ucx"])
def test_close_with_fifty_stalled_peers_ends_within_one_deadline(backend: str) -> None:
    if backend not in transport.available():
        pytest.skip(f"{backend} is not installed")
    peers = Frozen(backend, 50)
    tx = transport.create(backend, connect_timeout=5.0)
    try:
        src = tx.register(torch.ones(1 << 16, dtype=torch.uint8))

        def warm(peer: dict) -> None:  # a warm link: a write landed and was acknowledged
            tx.connect(peer["address"]).write(src, peer["descriptor"], ROW).wait(WAIT)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(warm, peers.peers))
        assert len(tx.outbound.links()) == 50
        peers.freeze()  # fifty peers alive, their sockets open, nobody reading
        started = time.monotonic()
        tx.close()
        took = time.monotonic() - started
        # One deadline for the whole close (5 + 1 + 2 s here), not BYE_WAIT per stalled peer
        # (50 x 1 s on nixl and ucx before): the goodbyes ran at once.
        assert took < tx.close_timeout, f"close took {took:.1f} s with 50 stalled peers"
        assert not tx.outbound.links() and not src.registered
    finally:
        tx.close()
        peers.kill()
