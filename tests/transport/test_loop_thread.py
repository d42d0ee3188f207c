"""The kit's progress-loop thread (`transport.loop_thread`, #29): stop, kick, join, one failure policy.

Every case synchronises on events the loop sets, never on sleeps; the
only timeouts are bounds on how long a wait may take under load.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from pdxfer.transport.errors import TransportError
from pdxfer.transport.loop_thread import LoopThread
from pdxfer.transport.testing import Backend, Rig

from pdxfer import transport

WAIT = 10.0  # a bound under load, never waited out when the code is right


def test_a_round_that_raises_ends_the_loop_logged_once_and_fails_what_is_pending(
        caplog: pytest.LogCaptureFixture) -> None:
    rounds, failed, heard = [], threading.Event(), []

    def turn() -> float:
        rounds.append(1)
        raise ValueError("bug in round 1")

    def on_failure(error: TransportError) -> None:
        heard.append((error, threading.current_thread().name))
        failed.set()

    with caplog.at_level(logging.ERROR, logger="pdxfer.transport.loop_thread"):
        loop = LoopThread("test-loop", turn, on_failure=on_failure)
        assert failed.wait(WAIT), "on_failure never ran"
        assert loop.stop(WAIT)
    assert len(rounds) == 1  # not retried in a tight loop
    (error, where), = heard
    assert where == "test-loop-failed"  # off the loop's thread: it may wait for things that wait for it
    assert loop.failure is error and isinstance(error.__cause__, ValueError)
    with pytest.raises(TransportError, match=r"test-loop: the progress loop failed \(ValueError: "
                                             r"bug in round 1\).*close the engine"):
        raise error
    assert [r.exc_info[1] for r in caplog.records] == [error.__cause__]  # logged once, with traceback


def test_a_kick_during_a_round_is_not_lost() -> None:
    in_round, go_on, second = threading.Event(), threading.Event(), threading.Event()
    count = [0]

    def turn() -> float:
        count[0] += 1
        if count[0] == 1:
            in_round.set()
            assert go_on.wait(WAIT)
        elif count[0] == 2:
            second.set()
        return 3600.0  # sleeps "forever" unless kicked

    loop = LoopThread("test-kick", turn)
    try:
        assert in_round.wait(WAIT)
        loop.kick()  # arrives while round 1 runs
        go_on.set()
        assert second.wait(WAIT), "the kick during round 1 was lost: round 2 waits an hour"
    finally:
        assert loop.stop(WAIT)
    assert loop.failure is None


def test_stop_joins_within_its_deadline_and_says_when_the_thread_is_stuck() -> None:
    entered, release = threading.Event(), threading.Event()

    def turn() -> float:
        entered.set()
        release.wait(WAIT)  # a handler stuck on something else
        return 0.0

    loop = LoopThread("test-stuck", turn)
    assert entered.wait(WAIT)
    assert loop.stop(0.05) is False and loop.alive and loop.stopping
    release.set()
    assert loop.stop(WAIT) is True and not loop.alive


def test_stop_from_the_loops_own_thread_only_asks() -> None:
    asked = threading.Event()
    box: list = []

    def turn() -> float:
        box.append(holder[0].stop(WAIT))  # a handler closing its engine: must not wait for itself
        asked.set()
        return 0.0

    holder: list[LoopThread] = []
    gate = threading.Event()

    def gated() -> float:
        gate.wait(WAIT)
        return turn()

    holder.append(LoopThread("test-self-stop", gated))
    gate.set()
    assert asked.wait(WAIT)
    assert box == [False]  # it did not join itself (that would have waited the whole WAIT)
    assert holder[0].stop(WAIT)


@pytest.mark.parametrize("name", ["nixl", "verbs-sim"])
def test_a_backend_whose_progress_round_raises_fails_its_links_writes_at_once(name: str) -> None:
    # The wiring, per backend that runs on the kit: `on_failure` = `EngineBase.progress_failed`.
    # Without it a write on the dead loop would wait out WAIT and raise TransferTimeout.
    if name not in transport.available():
        pytest.skip(f"backend {name} is not available here")
    rig = Rig(Backend.named(name))
    try:
        table = np.array([[0, 0, 4096]], np.int64)
        rig.conn.write(rig.src_region, rig.remote, table).wait(WAIT)  # warm: the loop works
        progress = rig.tx._progress  # the test breaks the loop from inside: no public hook for that

        entered = threading.Event()

        def broken() -> object:
            entered.set()
            raise RuntimeError("injected round bug")

        progress._round = broken
        progress.kick()
        # The write must come after the failure reached the link: on a loaded host a write
        # posted before the broken round ran could complete (verbs-sim completes on post).
        assert entered.wait(WAIT)
        deadline = time.monotonic() + WAIT  # bounded: without the wiring nothing severs it
        while rig.conn.error is None and time.monotonic() < deadline:
            entered.wait(0.01)  # a poll: the sever has no event of its own to wait on
        with pytest.raises(TransportError, match=r"progress loop failed \(RuntimeError: injected "
                                                 r"round bug\)"):
            rig.conn.write(rig.src_region, rig.remote, table).wait(WAIT)
    finally:
        rig.close()
