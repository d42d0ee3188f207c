"""The ucx engine's only UCX thread dying never leaves anyone waiting (#29.6).

A raise injected into the loop itself (not a queued call, which is logged
and survived): an `ask` queued at that moment, a write whose handle waits
for its ack, and any later `call` all fail at once with a `TransportError`
chained to the injected error, which is logged once with its traceback.
Without the catch-all the thread ends silently and each of them waits out
its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from pdxfer import transport

pytestmark = pytest.mark.skipif("ucx" not in transport.available(),
                                reason="ucxx-cu12 is not installed (pip install 'pdxfer[ucx]')")

WAIT = 30.0
ASK_TIMEOUT = 20.0  # what a waiter would wait out without the catch-all



def causes(exc: BaseException) -> list[BaseException]:
    """`exc`'s `__cause__` chain, outermost first (without `exc`)."""
    chain = []
    while exc.__cause__ is not None and len(chain) < 16:
        exc = exc.__cause__
        chain.append(exc)
    return chain

def test_a_failure_of_the_ucx_thread_fails_every_waiter_at_once_with_its_cause(caplog) -> None:
    from pdxfer.transport.errors import ClosedError, TransportError

    tx, rx = transport.create("ucx"), transport.create("ucx")
    entered, release = threading.Event(), threading.Event()
    try:
        src = tx.register(torch.ones(4096, dtype=torch.uint8))
        dst = rx.register(torch.zeros(4096, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        conn.write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)

        def hold(sender: str, payload: bytes) -> None:
            entered.set()
            release.wait(WAIT)

        rx.set_notify_handler(hold)
        pending = conn.write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64), notify=b"n")
        assert entered.wait(WAIT)  # its bytes landed; its ack waits for the handler: pending

        progress = tx.progress
        injected = RuntimeError("injected into the UCX loop")
        queued = threading.Event()
        real_call = progress.call
        asked: list[BaseException | object] = []
        answered = threading.Event()

        def call(fn):  # the ask below is registered and queued once this returns
            real_call(fn)
            queued.set()

        def ask() -> None:
            try:
                asked.append(progress.ask(lambda: "ran", ASK_TIMEOUT, "a probe"))
            except BaseException as exc:
                asked.append(exc)
            answered.set()

        def boom() -> None:
            progress.call = call
            threading.Thread(target=ask, daemon=True).start()
            assert queued.wait(WAIT)
            raise injected

        caplog.set_level(logging.ERROR, logger="pdxfer.transport.ucx.progress")
        started = time.monotonic()
        progress._complete = boom  # the loop's own step, run every pass
        progress.kick()

        with pytest.raises(TransportError) as failed:
            pending.wait(ASK_TIMEOUT)
        # the handle re-raises a fresh copy chained from the stored error (errors.again)
        assert injected in causes(failed.value), failed.value
        assert "UCX thread failed" in str(failed.value)
        progress._thread.join(WAIT)
        assert not progress.alive
        assert answered.wait(WAIT)
        assert len(asked) == 1 and isinstance(asked[0], TransportError), asked
        assert injected in causes(asked[0])
        assert time.monotonic() - started < ASK_TIMEOUT / 2, "a waiter waited out its timeout"
        with pytest.raises(ClosedError, match="UCX thread has ended") as late:
            progress.call(lambda: None)
        assert injected in causes(late.value)
        logged = [r for r in caplog.records if "the UCX thread failed" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info[1] is injected
    finally:
        release.set()
        tx.close()
        rx.close()
