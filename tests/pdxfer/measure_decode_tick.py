"""What one decode tick costs with N requests waiting for input (#29.6): a figure, not a test.

    .venv/bin/python tests/pdxfer/measure_decode_tick.py [N]

Expects N requests from a prefill that never sends, so every one sits in
WaitingForInput with a long timeout, then times the CPU the decode's ticks take on
its progress thread for five seconds and prints the median and the worst. The cost per tick is the figure: while any request is
aborting or settling the decode ticks every 5 ms, so 20 ms a tick is the
whole thread.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, KVPoll, PrefillEngine


def main(n: int) -> None:
    prefill = PrefillEngine(build_pools(64, 16, seed=1), config("loopback", timeout=120.0))
    decode = DecodeEngine(build_pools(64, 16, seed=2), config("loopback", timeout=120.0))
    try:
        for i in range(n):
            decode.expect(f"r{i}", prefill.bootstrap_address,
                          {"kv": np.array([i % 64]), "state": np.array([i % 16])})
        deadline = time.monotonic() + 120
        while decode.poll(f"r{n - 1}") is not KVPoll.WaitingForInput:
            assert time.monotonic() < deadline, "the Expects never went out"
            time.sleep(0.01)
        took: list[float] = []
        progress = decode._progress  # a measurement reaches in; the engine offers no tick hook
        inner = progress._tick
        lock = threading.Lock()

        def timed(now: float) -> float:
            # CPU time of the progress thread: what a tick costs, whatever else loads the host
            t = time.thread_time()
            try:
                return inner(now)
            finally:
                with lock:
                    took.append(time.thread_time() - t)

        progress._tick = timed
        time.sleep(5.0)
        progress._tick = inner
        with lock:
            ms = sorted(x * 1e3 for x in took)
        print(f"{n} requests waiting: {len(ms)} ticks in 5 s, CPU per tick: median "
              f"{statistics.median(ms):.3f} ms, max {ms[-1]:.3f} ms")
    finally:
        decode.close()
        prefill.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
