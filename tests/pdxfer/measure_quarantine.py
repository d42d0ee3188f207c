"""Measure the quarantine's bounds (#11); prints the table in docs/reliability.md.

    .venv/bin/python tests/pdxfer/measure_quarantine.py [reps]

The scenarios of `test_engine_quarantine.py`, timed from outside the engines
(so the figures include scheduling noise): how long a request whose prefill
is still writing stays Quarantined when the prefill cuts it after its own
grace, how soon the prefill's ack ends it, and how soon a SIGKILLed prefill
releases an orphaned one.
"""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdxfer_procs import Prefill  # noqa: E402
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, until  # noqa: E402
from test_engine_quarantine import NIXL_CMA, DeafPrefill, GatedConnection  # noqa: E402

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed, transport  # noqa: E402

PREFILL_GRACE, DECODE_WAIT, DECODE_GRACE = 1.0, 0.4, 0.3


class _Patch:
    """The bit of pytest's monkeypatch `DeafPrefill` uses."""

    def setattr(self, obj, name, value) -> None:
        setattr(obj, name, value)


def _pair(param: str):
    backend, options = ("nixl", NIXL_CMA) if param == "nixl-cma" else (param, {"fence": False})
    theirs = NIXL_CMA if backend == "nixl" else {}
    prefill = PrefillEngine(build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS),
                            config(backend, request_timeout=60.0, abort_grace=PREFILL_GRACE,
                                   transport_options=theirs))
    decode = DecodeEngine(build_pools(256, 16, seed=2, kv_fields=BIG_KV_FIELDS),
                          config(backend, request_timeout=DECODE_WAIT, abort_grace=DECODE_GRACE,
                                 transport_options=options))
    gate, held = threading.Event(), []
    real = prefill._transport.connect
    prefill._transport.connect = lambda addr: GatedConnection(real(addr), gate, held)
    return prefill, decode, gate, held


def _failed_at(decode: DecodeEngine, rid: str) -> float:
    try:
        decode.wait(rid, 30.0)
    except RequestFailed:
        return time.monotonic()
    raise AssertionError(f"{rid} did not fail")


def held_until_cut(param: str, rid: str) -> tuple[float, float]:
    """(seconds Quarantined, expect -> Failed) when the prefill cuts its stuck transfer itself."""
    prefill, decode, gate, held = _pair(param)
    try:
        t0 = time.monotonic()
        decode.expect(rid, prefill.bootstrap_address, {"kv": list(range(16))})
        prefill.send(rid, {"kv": list(range(16))})
        until(lambda: decode.poll(rid) in (KVPoll.Quarantined, KVPoll.Failed), "quarantined", 30.0)
        tq = time.monotonic()
        assert decode.poll(rid) is KVPoll.Quarantined, decode.outcome(rid)
        tf = _failed_at(decode, rid)
        return tf - tq, tf - t0
    finally:
        gate.set()
        decode.close()
        prefill.close()


def ack_to_failed(param: str, rid: str) -> float:
    """Seconds from the prefill hearing the Abort (its transfers done) to the decode's Failed."""
    prefill, decode, gate, held = _pair(param)
    deaf = DeafPrefill(prefill, _Patch())
    deaf.arm()
    try:
        decode.expect(rid, prefill.bootstrap_address, {"kv": list(range(16))})
        prefill.send(rid, {"kv": list(range(16))})
        until(lambda: decode.poll(rid) is KVPoll.Quarantined, "quarantined", 30.0)
        gate.set()
        until(lambda: held and held[0].real is not None and held[0].real.poll(), "landed", 30.0)
        t0 = time.monotonic()
        deaf.hear()
        return _failed_at(decode, rid) - t0
    finally:
        gate.set()
        decode.close()
        prefill.close()


def kill_to_failed(rid: str) -> float:
    """Seconds from SIGKILL of a frozen prefill process to the orphaned request's Failed (tcp)."""
    decode = DecodeEngine(build_pools(256, 16, seed=2, kv_fields=BIG_KV_FIELDS),
                          config("tcp", timeout=1.0, request_timeout=DECODE_WAIT,
                                 transport_options={"fence": False}))
    prefill = Prefill("tcp", timeout=1.0)  # heartbeats keep its link alive until the freeze
    try:
        decode.expect("w", prefill.address, {"kv": [3]})
        prefill.send("w", [7], [])
        assert decode.wait("w", 30.0) is KVPoll.Success
        decode.expect(rid, prefill.address, {"kv": [10, 11]})
        prefill.freeze()
        until(lambda: "data connections closed" in (decode.outcome(rid).reason or ""), "orphaned", 30.0)
        t0 = time.monotonic()
        prefill.kill(signal.SIGKILL)
        return _failed_at(decode, rid) - t0
    finally:
        prefill.kill(signal.SIGKILL)
        prefill.stop()
        decode.close()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} / {max(xs) * 1e3:.0f}"


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    params = ["loopback", "tcp"] + (["nixl-cma"] if "nixl" in transport.available() else [])
    print(f"decode request_timeout {DECODE_WAIT} s, decode grace {DECODE_GRACE} s, prefill grace "
          f"{PREFILL_GRACE} s; ms, median / max of {reps}\n")
    print("| backend | Quarantined, prefill cuts after its grace | expect → Failed | ack → Failed |")
    print("| --- | --- | --- | --- |")
    for param in params:
        cut = [held_until_cut(param, f"c{i}") for i in range(reps)]
        ack = [ack_to_failed(param, f"a{i}") for i in range(reps)]
        print(f"| {param} | {_fmt([c[0] for c in cut])} | {_fmt([c[1] for c in cut])} | {_fmt(ack)} |")
    kills = [kill_to_failed(f"k{i}") for i in range(reps)]
    print(f"\nSIGKILL of a frozen prefill → orphaned request Failed (tcp): {_fmt(kills)} ms")


if __name__ == "__main__":
    main()
