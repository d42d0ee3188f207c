"""A real prefill process killed (SIGKILL) or frozen (SIGSTOP) while a decode waits on it.

Cross-process backends only (`cross_backend`): the prefill must be another
process for its death to be an OS-level event — sockets reset by the kernel,
no goodbye — and for a stall to be a process that is alive but silent.
"""

from __future__ import annotations

import signal
import time

import pytest
from pdxfer_procs import Prefill
from pdxfer_testkit import (
    BIG_KV_FIELDS,
    assert_buffers,
    build_pools,
    config,
    expected_after,
    snapshot,
)

from pdxfer import DecodeEngine, KVPoll, RequestFailed

PAGES = 64


def _until_data_flows(decode: DecodeEngine, rid: str) -> None:
    until = time.monotonic() + 10.0
    while decode.poll(rid) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
        assert time.monotonic() < until, f"no data for {rid} ever arrived"
        time.sleep(0.0005)


def test_prefill_sigkilled_mid_send(cross_backend) -> None:
    cfg = config(cross_backend)
    src = build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS)  # what the process holds
    dst = build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    before = snapshot(dst)
    decode = DecodeEngine(dst, cfg)
    prefill = Prefill(cross_backend)
    port = int(prefill.address.rsplit(":", 1)[1])
    try:
        rids = [f"k{i}" for i in range(6)]
        for i, rid in enumerate(rids):
            decode.expect(rid, prefill.address, {"kv": list(range(PAGES * i, PAGES * i + PAGES)), "state": [i]})
        for i, rid in enumerate(rids[:4]):  # 4 of 6 are sent, the kill lands while they fly
            prefill.send(rid, list(range(PAGES)), [i])
        _until_data_flows(decode, rids[0])
        prefill.kill()
        t0 = time.monotonic()
        outcome = {}
        for rid in rids:
            try:
                outcome[rid] = decode.wait(rid, 10.0)
            except RequestFailed as exc:
                outcome[rid] = exc.reason
        bound = cfg.timeout + cfg.grace + 1.0
        assert time.monotonic() - t0 < bound, outcome
        for rid in rids[4:]:  # never sent: must have failed, and named the prefill as lost
            assert isinstance(outcome[rid], str) and "lost" in outcome[rid], outcome[rid]
        # Requests that did complete hold exactly the source bytes.
        done = [i for i, rid in enumerate(rids) if outcome[rid] is KVPoll.Success]
        moves = [m for i in done for m in (("kv", list(range(PAGES)), list(range(PAGES * i, PAGES * i + PAGES))),
                                           ("state", [i], [i]))]
        want = expected_after(dst, before, src, moves)
        for i in done:
            sl = slice(PAGES * i * dst["kv"].entry_bytes, PAGES * (i + 1) * dst["kv"].entry_bytes)
            assert (dst["kv"].buf[sl] == want["kv"][0][sl]).all()
        for rid in rids:
            decode.release(rid)  # freed: the entries are the caller's
        # A new prefill process on the same port serves the next request.
        prefill.stop()
        prefill = Prefill(cross_backend, port=port)
        assert prefill.address.endswith(f":{port}")
        before = snapshot(dst)
        decode.expect("next", prefill.address, {"kv": list(range(400, 400 + PAGES)), "state": [15]})
        prefill.send("next", list(range(PAGES, 2 * PAGES)), [3])
        assert decode.wait("next", 10.0) is KVPoll.Success
        assert_buffers(dst, expected_after(dst, before, src, [
            ("kv", list(range(PAGES, 2 * PAGES)), list(range(400, 400 + PAGES))), ("state", [3], [15])]))
    finally:
        prefill.stop()
        decode.close()


def test_prefill_frozen_by_sigstop_fails_within_the_bound(cross_backend) -> None:
    cfg = config(cross_backend, timeout=1.0)
    dst = build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    decode = DecodeEngine(dst, cfg)
    prefill = Prefill(cross_backend, timeout=1.0)
    try:
        decode.expect("frozen", prefill.address, {"kv": [1, 2], "state": [1]})
        decode.expect("warm", prefill.address, {"kv": [3]})
        prefill.send("warm", [7], [])  # proves the link is up before the freeze
        assert decode.wait("warm", 10.0) is KVPoll.Success
        prefill.freeze()
        t0 = time.monotonic()
        with pytest.raises(RequestFailed, match="silent for|timed out"):
            decode.wait("frozen", 10.0)
        assert time.monotonic() - t0 < cfg.timeout + cfg.grace + 1.0
        decode.release("frozen")
    finally:
        prefill.kill(signal.SIGKILL)
        prefill.stop()
        decode.close()
