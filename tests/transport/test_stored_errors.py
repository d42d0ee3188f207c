"""A stored error raised again and again keeps a constant traceback (#29 item 6).

A handle's, a link's or a post queue's failure is kept and raised to every
later caller. Raised in place, the one exception object grew by the raising
frames each time: 2,000 frames after 1,000 polls of a failed handle. Each
raise is now a fresh copy chained `from` the stored error.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from pdxfer.transport import ClosedError, PeerLostError
from pdxfer.transport.handles import Handle
from pdxfer.transport.testing.rig import WAIT

from pdxfer import transport


def depth(exc: BaseException) -> int:
    return len(traceback.extract_tb(exc.__traceback__))


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:  # the error a caller gets
        return exc
    raise AssertionError("did not raise")


def test_a_failed_handle_polled_a_thousand_times_keeps_its_traceback() -> None:
    handle = Handle(4096, "a transfer")
    stored = PeerLostError("the peer went away")
    handle.fail(stored)
    first = [depth(raised(handle.poll)), depth(raised(lambda: handle.wait(1.0)))]
    for _ in range(1000):
        raised(handle.poll)
        raised(lambda: handle.wait(1.0))
    last = raised(handle.poll)
    assert [depth(last), depth(raised(lambda: handle.wait(1.0)))] == first
    assert depth(stored) == 0 and stored.__traceback__ is None  # never raised itself
    assert isinstance(last, PeerLostError) and str(last) == "the peer went away"
    assert last.__cause__ is stored


def test_a_dead_link_raises_a_constant_traceback_on_every_write() -> None:
    rx, tx = transport.create("tcp"), transport.create("tcp")
    try:
        dst = rx.register(torch.zeros(4096, dtype=torch.uint8))
        src = tx.register(torch.ones(4096, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        rows = np.array([[0, 0, 4096]], np.int64)
        conn.write(src, dst.descriptor(), rows).wait(WAIT)
        conn.close()

        def write() -> None:
            conn.write(src, dst.descriptor(), rows)

        first = depth(raised(write))
        for _ in range(1000):
            raised(write)
        last = raised(write)
        assert isinstance(last, ClosedError) and depth(last) == first
        with pytest.raises(ClosedError, match="closed"):
            write()
    finally:
        tx.close()
        rx.close()
