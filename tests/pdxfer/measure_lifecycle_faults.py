"""Measure the bounds of issue #8's fault cases; prints the table in docs/reliability.md.

    .venv/bin/python tests/pdxfer/measure_lifecycle_faults.py

Same scenarios as `test_engine_stall.py` / `test_engine_lifecycle_faults.py`,
timed from outside the engines (so the figures include scheduling noise).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdxfer_procs import Decode, Prefill  # noqa: E402
from pdxfer_testkit import (  # noqa: E402
    BIG_KV_FIELDS,
    CROSS_PROCESS,
    build_pools,
    config,
    poll_or_none,
    until,
)

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed, transport  # noqa: E402


def stalled_decode(backend: str) -> tuple[float, float, float]:
    """(max send/poll seconds on the stalled peer, its failure after the freeze, healthy ok ratio)."""
    cfg = config(backend, timeout=2.0)
    prefill = PrefillEngine(build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS), cfg)
    healthy = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    stalled = Decode(backend, timeout=2.0)
    addr = prefill.bootstrap_address
    try:
        stalled.expect("w", addr, [0, 1], [])
        prefill.send("w", {"kv": [0, 1]})
        assert stalled.wait("w") == "OK w"
        stalled.expect("c", addr, [4], [])
        stalled.expect("s", addr, [8], [1])
        for rid in "cs":
            until(lambda rid=rid: poll_or_none(prefill, rid) is KVPoll.WaitingForInput, rid)
        stalled.freeze()
        t0 = time.monotonic()
        prefill.send("c", {"kv": [4]})
        worst = time.monotonic() - t0
        prefill.abort("c")
        try:
            prefill.wait("c", 30)
        except RequestFailed:
            pass
        t1 = time.monotonic()
        prefill.send("s", {"kv": [8], "state": [1]})
        worst = max(worst, time.monotonic() - t1)
        ok = 0
        for i in range(20):
            healthy.expect(f"h{i}", addr, {"kv": [i], "state": [i % 16]})
            t2 = time.monotonic()
            prefill.send(f"h{i}", {"kv": [i], "state": [i % 16]})
            worst = max(worst, time.monotonic() - t2)
        for i in range(20):
            ok += healthy.wait(f"h{i}", 30) is KVPoll.Success
        try:
            prefill.wait("s", 30)
        except RequestFailed:
            pass
        return worst, time.monotonic() - t0, ok / 20
    finally:
        stalled.stop()
        healthy.close()
        prefill.close()


def fenced_prefill(backend: str) -> float:
    """Seconds from SIGCONT of a fenced prefill to the next request's Success."""
    cfg = config(backend, timeout=3.0)
    decode = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    prefill = Prefill(backend, timeout=3.0)
    try:
        decode.expect("w", prefill.address, {"kv": [1]})
        prefill.send("w", [5], [])
        decode.wait("w", 30)
        decode.expect("d", prefill.address, {"kv": [2]})
        prefill.until("d", "WaitingForInput")
        prefill.freeze()
        decode.abort("d")
        try:
            decode.wait("d", 30)
        except RequestFailed:
            pass
        prefill.kill(signal.SIGCONT)
        t0 = time.monotonic()
        decode.expect("n", prefill.address, {"kv": [3]})
        prefill.send("n", [6], [])
        assert decode.wait("n", 30) is KVPoll.Success
        return time.monotonic() - t0
    finally:
        prefill.stop()
        decode.close()


def abort_before_expect(backend: str) -> float:
    """Seconds for a prefill's waiting send() to fail after the decode aborted it."""
    cfg = config(backend)
    with (PrefillEngine(build_pools(64, 16), cfg) as prefill,
          DecodeEngine(build_pools(64, 16), cfg) as decode):
        prefill.send("e", {"kv": [1]})
        t0 = time.monotonic()
        decode.expect("e", prefill.bootstrap_address, {"kv": [1]})
        decode.abort("e")
        try:
            prefill.wait("e", 30)
        except RequestFailed:
            pass
        return time.monotonic() - t0


def main() -> None:
    print("| case | backend | bound | measured |")
    print("| --- | --- | --- | --- |")
    for backend in transport.available():
        if backend in CROSS_PROCESS:  # the stalled peer is a second process
            worst, failed, ok = stalled_decode(backend)
            print(f"| stalled decode: send()/poll() on it | {backend} | microseconds of local work "
                  f"(old: 10 s connect/region wait) | max {worst * 1e3:.2f} ms |")
            print(f"| stalled decode: its requests fail | {backend} | timeout + grace = 2.3 s "
                  f"| {failed:.2f} s |")
            print(f"| stalled decode: other decode's requests | {backend} | all succeed | {ok:.0%} |")
            print(f"| fenced prefill resumes: next request | {backend} | succeeds | "
                  f"Success in {fenced_prefill(backend):.2f} s |")
        print(f"| abort before Expect: prefill knows | {backend} | one round trip (< request wait 2 s) "
              f"| {abort_before_expect(backend) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
