"""Issue #8's faults that need a real second process: a decode or a prefill frozen by SIGSTOP.

Cross-process backends only (`cross_backend`: tcp, nixl).

1. One stalled decode must not freeze the prefill: after a transfer to it
   was cut (so the data connection must be reopened) the prefill's `send()`
   to it returns at once — no connect, handshake or region lookup on the
   caller's thread or under the lock — another decode's requests all
   succeed meanwhile, and the stalled decode's requests fail within
   `timeout + abort_grace` (+ scheduling slack).
2. A prefill that the decode fenced while it was stopped serves the next
   request once it resumes (no write into the fenced connection).
"""

from __future__ import annotations

import signal
import time

import pytest
from pdxfer_procs import Decode, Prefill
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, poll_or_none, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed

WAIT = 30.0
# What CPU load may add to a bound measured from outside the engine (the
# suite must pass with both cores busy); the contract itself is the first term.
SLACK = 1.0


def test_a_stalled_decode_fails_only_its_own_requests_and_never_blocks_the_prefill(cross_backend) -> None:
    cfg = config(cross_backend, timeout=2.0)
    prefill = PrefillEngine(build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS), cfg)
    healthy = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    stalled = Decode(cross_backend, timeout=2.0)
    addr = prefill.bootstrap_address
    try:
        # The stalled decode served one request, kv only: its state region was never written.
        stalled.expect("s-warm", addr, list(range(4)), [])
        prefill.send("s-warm", {"kv": list(range(4))})
        assert stalled.wait("s-warm") == "OK s-warm"
        stalled.expect("s-cut", addr, list(range(10, 14)), [])
        stalled.expect("s-stuck", addr, list(range(20, 24)), [1])
        for rid in ("s-cut", "s-stuck"):
            until(lambda rid=rid: poll_or_none(prefill, rid) is KVPoll.WaitingForInput, "Expect seen")
        stalled.freeze()
        t0 = time.monotonic()
        prefill.send("s-cut", {"kv": list(range(4))})  # never confirmed by the stopped process
        took = time.monotonic() - t0
        prefill.abort("s-cut")  # past the grace its transfer is cut: the connection must reopen
        with pytest.raises(RequestFailed, match="aborted by prefill"):
            prefill.wait("s-cut", WAIT)
        t1 = time.monotonic()
        prefill.send("s-stuck", {"kv": list(range(20, 24)), "state": [1]})  # and a cold region
        took = max(took, time.monotonic() - t1)
        for i in range(8):
            healthy.expect(f"h{i}", addr, {"kv": [8 * i, 8 * i + 1], "state": [i]})
            t1 = time.monotonic()
            prefill.send(f"h{i}", {"kv": [i, i + 1], "state": [i]})
            took = max(took, time.monotonic() - t1)
        t2 = time.monotonic()
        assert prefill.poll("s-stuck") is not KVPoll.Success  # queued until the link reopens, or failed
        took = max(took, time.monotonic() - t2)
        for i in range(8):
            assert healthy.wait(f"h{i}", WAIT) is KVPoll.Success, healthy.failure_reason(f"h{i}")
            assert prefill.wait(f"h{i}", WAIT) is KVPoll.Success
        with pytest.raises(RequestFailed, match="silent for|lost|cut|did not confirm|cannot reach"):
            prefill.wait("s-stuck", WAIT)
        failed_after = time.monotonic() - t0
        # The old engine waited a transport connect/region timeout (10 s) here, under its lock.
        assert took < cfg.timeout / 2, f"send() blocked {took:.2f} s on a stalled peer"
        assert failed_after < cfg.timeout + cfg.grace + SLACK, failed_after
    finally:
        stalled.stop()
        healthy.close()
        prefill.close()


def test_a_prefill_fenced_while_stopped_serves_the_next_request(cross_backend) -> None:
    cfg = config(cross_backend, timeout=3.0)
    decode = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    prefill = Prefill(cross_backend, timeout=3.0)
    addr = prefill.address
    try:
        decode.expect("warm", addr, {"kv": [1], "state": [1]})
        prefill.send("warm", [5], [2])
        assert decode.wait("warm", WAIT) is KVPoll.Success
        decode.expect("doomed", addr, {"kv": [2]})
        assert prefill.until("doomed", "WaitingForInput") == "AT doomed WaitingForInput"
        prefill.freeze()
        decode.abort("doomed")
        with pytest.raises(RequestFailed, match="fenced it"):
            decode.wait("doomed", WAIT)  # no AbortAck within the grace: drop_peer
        prefill.kill(signal.SIGCONT)
        for i in range(3):
            rid = f"next{i}"
            decode.expect(rid, addr, {"kv": [10 + i], "state": [2 + i]})
            prefill.send(rid, [20 + i], [3 + i])
            assert decode.wait(rid, WAIT) is KVPoll.Success, decode.failure_reason(rid)
            assert prefill.wait(rid) == f"OK {rid}"
    finally:
        prefill.stop()
        decode.close()
