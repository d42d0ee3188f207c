"""A prefill over verbs whose producer's CUDA event is not reached yet: `send()` returns at once.

Issue #20: verbs used to wait for the producer's event on the caller's thread, with the
prefill's table lock held — a `send()` right after launching the forward pass blocked for the
whole forward pass while `poll()`, handlers and heartbeats queued behind it. Now the write
waits in its link's ordered post queue (the kit's `transport.posting`), asked by the engine's
readiness thread, and nothing else waits with it.

No GPU here, so the event is a stand-in with `query()` — all the post queue asks of a
`torch.cuda.Event` — handed in where the engine captures readiness (`PoolSet.readiness`,
`link.capture`), as the kit's own readiness case does. Two decodes: one whose request waits
for the producer, one whose request must go through meanwhile on the same prefill. The
liveness timeout is short (0.5 s) and the wait outlasts it three times over: were heartbeats
held up, the waiting request's decode would declare the prefill lost.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from pdxfer.transport import TransferTimeout
from pdxfer.transport import link as link_module
from pdxfer.transport.testing.cases_engine import Producer  # a stand-in event: `query()` only
from pdxfer_testkit import build_pools, config, entries_crc, poll_or_none, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine
from pdxfer.pools import PoolSet

LIVENESS = 0.5
WAIT = 20.0


def test_send_with_an_unreached_event_returns_at_once_and_poll_and_heartbeats_go_on(monkeypatch) -> None:
    real_capture = link_module.capture
    monkeypatch.setattr(PoolSet, "readiness",
                        lambda self, ready: {r: ready for r in self.regions} if ready is not None else {})
    monkeypatch.setattr(link_module, "capture",
                        lambda ready, device: ready if isinstance(ready, Producer) else real_capture(ready, device))
    cfg = config("verbs-sim", timeout=LIVENESS, request_timeout=WAIT, connect_timeout=WAIT)
    src, dst = build_pools(64, 8, seed=1), build_pools(64, 8)
    with PrefillEngine(src, cfg) as prefill, DecodeEngine(dst, cfg) as waiting, \
            DecodeEngine(build_pools(64, 8), cfg) as other:
        idx = {"kv": np.arange(8), "state": [1]}
        waiting.expect("slow", prefill.bootstrap_address, idx)
        other.expect("fast", prefill.bootstrap_address, idx)
        for rid in ("slow", "fast"):  # both data links open: send() posts straight to the transport
            until(lambda rid=rid: poll_or_none(prefill, rid) is KVPoll.WaitingForInput, "Expect seen")
        producer = Producer()
        t0 = time.perf_counter()
        prefill.send("slow", idx, ready=producer)
        took = time.perf_counter() - t0
        assert producer.asked.wait(WAIT), "the write never reached its link's post queue"
        t0 = time.perf_counter()
        state = prefill.poll("slow")
        polled = time.perf_counter() - t0
        print(f"\nsend() with an unreached event: {took * 1e6:.0f} us; poll(): {polled * 1e6:.0f} us")
        assert took < 0.25 and polled < 0.25  # a blocked send would take the whole wait below
        assert state is KVPoll.Transferring
        prefill.send("fast", idx)  # another decode's request goes through meanwhile
        assert other.wait("fast", WAIT) is KVPoll.Success
        with pytest.raises(TransferTimeout):  # three liveness timeouts: only heartbeats keep it alive
            waiting.wait("slow", 3 * LIVENESS)
        assert waiting.poll("slow") is KVPoll.WaitingForInput and prefill.poll("slow") is KVPoll.Transferring
        producer.reached.set()
        assert waiting.wait("slow", WAIT) is KVPoll.Success
        assert prefill.wait("slow", WAIT) is KVPoll.Success
        for pool in ("kv", "state"):
            assert entries_crc(dst, pool, idx[pool]) == entries_crc(src, pool, idx[pool])
