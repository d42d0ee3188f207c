"""A stalled decode with an aborted transfer in flight never delays another decode (#29 item 3).

Issue #29's adversary sequence, two processes: prefill P and a healthy
decode D2 here, decode D1 in a process of its own. One request D1 <- P warms
D1's links; D1 expects a big request (16 MiB: far more than the sockets
between the two hold) and is SIGSTOPped; P sends it and aborts it with its
bytes in flight; then D2's requests must all succeed, each within the
engines' own request wait — nothing that waits on D1 may sit on a thread or
lock that serves D2. The issue saw D2's *later* requests time out on nixl and
ucx ("no progress for 2.0 s while WaitingForInput"; tcp held), so D2 asks
without pause, one request after another, from the abort until after each
thing P does about D1 — each phase marked on that event, not on a sleep:

1. at once: the abort is pending, the 16 MiB still queued to D1, D2's first
   handshake under way (D2 starts cold);
2. after `big` failed on P: its abort grace ran out and P cut (closed) its
   data connection to D1, which the stopped peer never answers;
3. after D1 left `P.peers()`: P declared it lost (silent for `timeout`) and
   closed its control link, with the data connection's reopen in between.

Not reproduced here on the issue's base commit (b97150b) nor since, on nixl
or ucx, in the variants docs/reliability.md lists (#29 item 3); the test
guards the whole timeline on every cross-process backend.
"""

from __future__ import annotations

import threading
import time

import pytest
from pdxfer_procs import Decode
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, poll_or_none, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed

TIMEOUT = 2.0  # the issue's: its D2 failed with "no progress for 2.0 s"
WAIT = 30.0  # a safety net far above every bound, so CPU load cannot fire it
BIG = list(range(500))  # 16 MiB
# A pause between D2's requests: pacing, not synchronisation (a stall shows as a request
# that outlives the request wait, whenever it starts). Back to back, the pump ran ~1,000
# requests a second and took 60 CPU-s of a loaded suite; at this pace a phase of TIMEOUT
# seconds still holds dozens of requests.
PACE = 0.05


class Pump:
    """D2's requests one after another on a thread of their own, from start() to stop().

    Each is waited before the next is asked, so a stall anywhere on the way —
    a handshake, a post, a confirmation — fails that request after the
    request wait; `mark(phase)` labels the requests asked from then on.
    """

    def __init__(self, prefill: PrefillEngine, decode: DecodeEngine) -> None:
        self.prefill, self.decode = prefill, decode
        self.phase, self.done = "inflight", {}  # phase -> [seconds per request]
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="d2-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def mark(self, phase: str) -> None:
        """Label later requests `phase`; returns once one of them has succeeded."""
        self.phase = phase
        until(lambda: self.done.get(phase) or self.failures, f"a request in phase {phase}", WAIT)

    def stop(self) -> dict[str, list[float]]:
        """End the pump after its current request; its durations per phase."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(WAIT)
            assert not self._thread.is_alive(), "a request of the healthy decode never ended"
        return self.done

    def _run(self) -> None:
        addr, n = self.prefill.bootstrap_address, 0
        while not self._stop.is_set():
            phase, rid, k = self.phase, f"h{n}", n % 200
            n += 1
            began = time.monotonic()
            try:
                self.decode.expect(rid, addr, {"kv": [2 * k, 2 * k + 1], "state": [k % 16]})
                self.prefill.send(rid, {"kv": [k, k + 1], "state": [k % 16]})
                self.decode.wait(rid, WAIT)
                self.prefill.wait(rid, WAIT)
            except Exception as exc:  # noqa: BLE001 — reported by the test's thread
                self.failures.append(f"{rid} ({phase}) after {time.monotonic() - began:.2f} s: {exc}")
                return
            self.done.setdefault(phase, []).append(time.monotonic() - began)
            self._stop.wait(PACE)


def test_an_aborted_transfer_to_a_stalled_decode_never_delays_another_decode(cross_backend) -> None:
    cfg = config(cross_backend, timeout=TIMEOUT)
    prefill = PrefillEngine(build_pools(512, 16, seed=1, kv_fields=BIG_KV_FIELDS), cfg)
    healthy = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    stalled = Decode(cross_backend, timeout=TIMEOUT)
    addr = prefill.bootstrap_address
    pump = Pump(prefill, healthy)
    try:
        stalled.expect("s-warm", addr, list(range(4)), [])
        prefill.send("s-warm", {"kv": list(range(4))})
        assert stalled.wait("s-warm") == "OK s-warm"
        stalled.expect("big", addr, [8 + i for i in BIG], [])
        until(lambda: poll_or_none(prefill, "big") is KVPoll.WaitingForInput, "Expect seen")
        stalled.freeze()
        prefill.send("big", {"kv": BIG})
        prefill.abort("big")
        pump.start()  # D2 starts cold: its first handshake runs beside the pending abort

        with pytest.raises(RequestFailed, match="abort"):
            prefill.wait("big", WAIT)  # the grace ran out and the cut's close returned
        pump.mark("cut")
        until(lambda: all(p.engine != stalled.address for p in prefill.peers()),
              "the stopped decode declared lost", WAIT)
        pump.mark("lost")
        done = pump.stop()
        assert not pump.failures, pump.failures
        assert set(done) == {"inflight", "cut", "lost"}, done
        # for a reader of -s: requests and the slowest, per phase
        print({phase: (len(t), round(max(t), 3)) for phase, t in done.items()})
    finally:
        pump.stop()
        stalled.stop()
        healthy.close()
        prefill.close()
