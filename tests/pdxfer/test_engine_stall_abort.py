"""A stalled decode with an aborted transfer in flight never delays another decode (#29 item 3).

Issue #29's adversary sequence, two processes: prefill P and a healthy
decode D2 here, decode D1 in a process of its own. One request D1 <- P warms
D1's links; D1 is SIGSTOPped; P sends D1 a big request (its bytes cannot all
leave: nobody reads them) and aborts it; then D2's requests must all succeed,
each within the engines' own timeout — nothing that waits on D1 may sit on a
thread or lock that serves D2. The issue saw them time out on nixl and ucx
("no progress for 2.0 s while WaitingForInput"; tcp held); this sequence (D2
cold, its requests posted while the aborted 16 MiB are still queued) did not
reproduce that on the code of the time in four variants tried, so it guards
the sequence on every cross-process backend rather than pinning a fix.
"""

from __future__ import annotations

import pytest
from pdxfer_procs import Decode
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, poll_or_none, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed

WAIT = 30.0
BIG = list(range(500))  # 16 MiB: far more than the sockets between the two hold


def test_an_aborted_transfer_to_a_stalled_decode_never_delays_another_decode(cross_backend) -> None:
    cfg = config(cross_backend, timeout=2.0)
    prefill = PrefillEngine(build_pools(512, 16, seed=1, kv_fields=BIG_KV_FIELDS), cfg)
    healthy = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
    stalled = Decode(cross_backend, timeout=2.0)
    addr = prefill.bootstrap_address
    try:
        stalled.expect("s-warm", addr, list(range(4)), [])
        prefill.send("s-warm", {"kv": list(range(4))})
        assert stalled.wait("s-warm") == "OK s-warm"
        stalled.expect("big", addr, [8 + i for i in BIG], [])
        until(lambda: poll_or_none(prefill, "big") is KVPoll.WaitingForInput, "Expect seen")
        stalled.freeze()
        prefill.send("big", {"kv": BIG})
        prefill.abort("big")
        for i in range(8):
            healthy.expect(f"h{i}", addr, {"kv": [8 * i, 8 * i + 1], "state": [i]})
            prefill.send(f"h{i}", {"kv": [i, i + 1], "state": [i]})
        for i in range(8):
            assert healthy.wait(f"h{i}", WAIT) is KVPoll.Success, healthy.failure_reason(f"h{i}")
            assert prefill.wait(f"h{i}", WAIT) is KVPoll.Success
        with pytest.raises(RequestFailed, match="abort"):
            prefill.wait("big", WAIT)
    finally:
        stalled.stop()
        healthy.close()
        prefill.close()
