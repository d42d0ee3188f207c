"""The decode's tick costs what is due, not what is held (#29.6).

At 10,000 waiting requests the tick used to run every request's timer under
the table lock (~70 ms of CPU a tick, every 5 ms while anything aborted);
`tests/pdxfer/measure_decode_tick.py` has the figure. Here: ticks with many
requests waiting and none due run no request's timer, and one that is due
still times out.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed
from pdxfer.lifecycle import DecodeLife

WAIT = 20.0


def test_ticks_with_nothing_due_run_no_request_timer(monkeypatch) -> None:
    calls = [0]
    inner = DecodeLife.on_tick

    def counted(self, now):
        calls[0] += 1
        return inner(self, now)

    monkeypatch.setattr(DecodeLife, "on_tick", counted)
    prefill = PrefillEngine(build_pools(64, 16, seed=1), config("loopback", timeout=60.0))
    decode = DecodeEngine(build_pools(64, 16, seed=2), config("loopback", timeout=60.0))
    try:
        n = 300
        for i in range(n):
            decode.expect(f"r{i}", prefill.bootstrap_address,
                          {"kv": np.array([i % 64]), "state": np.array([i % 16])})
        for i in range(n):
            assert decode.try_poll(f"r{i}") is not None
        ticks, seen = [0], threading.Event()
        progress = decode._progress  # the test counts the loop's ticks: no public hook for that
        tick = progress._tick

        def counting(now: float) -> float:
            out = tick(now)
            ticks[0] += 1
            if ticks[0] == 5:
                calls[0] = 0  # from here on every request is announced and far from its deadline
            if ticks[0] == 15:
                seen.set()
            return out

        progress._tick = counting
        assert seen.wait(WAIT), "the decode stopped ticking"
        progress._tick = tick
        assert decode.poll(f"r{n - 1}") in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
        assert calls[0] == 0, f"10 ticks with nothing due ran {calls[0]} request timers"
    finally:
        decode.close()
        prefill.close()


def test_a_request_whose_wait_ends_still_times_out() -> None:
    prefill = PrefillEngine(build_pools(64, 16, seed=1), config("loopback", timeout=0.5))
    decode = DecodeEngine(build_pools(64, 16, seed=2), config("loopback", timeout=0.5))
    try:
        decode.expect("slow", prefill.bootstrap_address, {"kv": np.array([1]), "state": [1]})
        with pytest.raises(RequestFailed, match=r"no progress for 0.5 s while WaitingForInput"):
            decode.wait("slow", WAIT)
    finally:
        decode.close()
        prefill.close()
