"""Requests/s and latency through the engines beside the bare transport, on the same tables.

Issue #13 goal 2 asks the PD engine to carry at least 0.9x the requests/s of
the bare transport and to show its latency beside the transport's. Both
sides here move the same requests between the same entry-major pools:

- `rate`: `batch` requests in flight. The engine's window runs from the
  first `send()` (every Expect already at the prefill, as in serving, where
  the decode announces a request long before the prefill finishes it) until
  every request is Success on both engines (the decode's notifies and the
  prefill's Done); the bare transport's from posting the first of the same
  tables, planned beforehand, until every write completed;
- `latency`: one request at a time, from `send()` until `decode.wait()`
  returns Success, against posting the same tables with a notify each until
  the receiving engine's notify handler has seen both — what the decode
  declares Success on.

`pdxfer bench request-cost` prints these beside its per-call costs; rounds
alternate engine and bare so a burst of outside load hits both.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdxfer import layout, transport

from ..config import EngineConfig, KVPoll
from ..decode import DecodeEngine
from ..prefill import PrefillEngine


def await_expects(prefill: PrefillEngine, rids: list[str]) -> None:
    """Until the prefill holds every rid's Expect, so send() posts at once."""
    deadline = time.monotonic() + 60.0
    for rid in rids:
        while prefill.try_poll(rid) is not KVPoll.WaitingForInput:
            if time.monotonic() > deadline:
                raise SystemExit(f"{rid}: the prefill never saw its Expect")
            time.sleep(0.0002)


def engine_run(pools: Any, backend: str, reqs: list, batch: int, small: list) -> dict[str, Any]:
    """Requests/s with `batch` in flight, then per-request latency of `small` one at a time."""
    cfg = EngineConfig(transport=backend, timeout=30.0)
    prefill = PrefillEngine(pools(), cfg)
    decode = DecodeEngine(pools(), cfg)
    addr = prefill.bootstrap_address
    busy, lat = 0.0, []
    try:
        for start in range(0, len(reqs), batch):
            chunk = list(enumerate(reqs[start:start + batch], start))
            for i, (_, dst) in chunk:
                decode.expect(f"r{i}", addr, dst)
            await_expects(prefill, [f"r{i}" for i, _ in chunk])
            t0 = time.perf_counter()
            for i, (src, _) in chunk:
                prefill.send(f"r{i}", src)
            for i, _ in chunk:
                if decode.wait(f"r{i}", 60.0) is not KVPoll.Success or \
                        prefill.wait(f"r{i}", 60.0) is not KVPoll.Success:
                    raise SystemExit(f"r{i}: {decode.failure_reason(f'r{i}')}")
            busy += time.perf_counter() - t0
            for i, _ in chunk:
                decode.release(f"r{i}")
                prefill.release(f"r{i}")
        for i, (src, dst) in enumerate(small):
            decode.expect(f"s{i}", addr, dst)
            await_expects(prefill, [f"s{i}"])
            t0 = time.perf_counter_ns()
            prefill.send(f"s{i}", src)
            state = decode.wait(f"s{i}", 60.0)
            lat.append(time.perf_counter_ns() - t0)
            if state is not KVPoll.Success or prefill.wait(f"s{i}", 60.0) is not KVPoll.Success:
                raise SystemExit(f"s{i}: {decode.failure_reason(f's{i}')}")
            decode.release(f"s{i}")
            prefill.release(f"s{i}")
    finally:
        decode.close()
        prefill.close()
    return {"rps": len(reqs) / busy, "latency_ns": lat}


def bare_run(pools: Any, backend: str, reqs: list, batch: int, small: list) -> dict[str, Any]:
    """The same two measurements posting planned tables on a bare connection pair."""
    src, dst = pools(), pools()
    a, b = transport.create(backend), transport.create(backend)
    seen = threading.Semaphore(0)
    b.set_notify_handler(lambda _sender, _payload: seen.release())
    busy, lat = 0.0, []
    try:
        local = {p: a.register(layout.arena_buffers(arena)[0]) for p, arena in src.items()}
        remote = {p: b.register(layout.arena_buffers(arena)[0]).descriptor() for p, arena in dst.items()}
        conn = a.connect(b.address())

        def tables(pair: tuple[dict, dict]) -> list:
            s, d = pair
            return [(local[p], remote[p], layout.plan_segments(src[p], s[p], d[p],
                                                               dst_entries=dst[p].entries)[0])
                    for p in s]

        planned = [tables(r) for r in reqs]
        for start in range(0, len(planned), batch):
            t0 = time.perf_counter()
            handles = [conn.write(*w) for per in planned[start:start + batch] for w in per]
            for h in handles:
                h.wait(60.0)
            busy += time.perf_counter() - t0
        for pair in small:
            writes = tables(pair)
            t0 = time.perf_counter_ns()
            for w in writes:
                conn.write(*w, b"landed")
            for _ in writes:
                if not seen.acquire(timeout=60.0):
                    raise SystemExit("a bare notify never arrived")
            lat.append(time.perf_counter_ns() - t0)
    finally:
        a.close()
        b.close()
    return {"rps": len(reqs) / busy, "latency_ns": lat}


def percentile(values: list[int], q: float) -> float:
    """The q-quantile (nearest rank) in microseconds."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0
