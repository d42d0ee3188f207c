"""Requests that fail: aborts from either side, duplicates, mismatches, stalls, dead peers.

Every failure must be reported with its reason, within a bounded time, and
must leave the decode's entries untouched afterwards: the tests reuse them
(write a canary, run another request through the same pair) and check the
canary survived.
"""

from __future__ import annotations

import time

import pytest
import torch
from pdxfer_testkit import (
    KV_FIELDS,
    assert_buffers,
    build_pools,
    config,
    expected_after,
    settle,
    snapshot,
)

from pdxfer import (
    DecodeEngine,
    KVPoll,
    LayoutMismatchError,
    PrefillEngine,
    RequestError,
    RequestFailed,
    TransferTimeout,
    layout,
)
from pdxfer.clock import ManualClock
from pdxfer.protocol import Done

WAIT = 10.0


def _heard(prefill: PrefillEngine, rid: str) -> None:
    """Block until the prefill has received the decode's Expect for `rid`."""
    until = time.monotonic() + WAIT
    while time.monotonic() < until:
        try:
            if prefill.poll(rid) is KVPoll.WaitingForInput:
                return
        except RequestError:
            pass
        time.sleep(0.002)
    raise AssertionError(f"prefill never heard the expect for {rid!r}")


def _canary(pools: dict, pool: str, entries: list[int]) -> None:
    arena = pools[pool]
    for field in arena.fields:
        raw = arena.view(field.name).view(torch.uint8)
        raw[:, entries] = 0xA5  # index assignment writes through; `raw[:, entries].fill_` would not


def _roundtrip(prefill, decode, rid: str, dst_kv: list[int]) -> None:
    """One more request through the pair: whatever an earlier one still had queued lands first."""
    decode.expect(rid, prefill.bootstrap_address, {"kv": dst_kv})
    prefill.send(rid, {"kv": list(range(len(dst_kv)))})
    assert decode.wait(rid, WAIT) is KVPoll.Success


def test_abort_from_decode_tells_prefill_and_late_send_lands_nothing(pair) -> None:
    prefill, decode, src, dst = pair
    decode.expect("a", prefill.bootstrap_address, {"kv": [10, 11], "state": [1]})
    _heard(prefill, "a")
    t0 = time.monotonic()
    decode.abort("a", "client went away")
    with pytest.raises(RequestFailed, match="aborted by decode: client went away"):
        decode.wait("a", WAIT)
    assert time.monotonic() - t0 < 1.5  # well inside the 2 s timeout: told, not timed out
    # The entries are the caller's again: reuse them, then let the prefill send late.
    decode.release("a")
    _canary(dst, "kv", [10, 11])
    before = snapshot(dst)
    prefill.send("a", {"kv": [0, 1], "state": [0]})
    assert prefill.poll("a") is KVPoll.Failed
    assert prefill.failure_reason("a") == "aborted by decode: client went away"
    _roundtrip(prefill, decode, "after-a", [500])
    assert_buffers(dst, expected_after(dst, before, src, [("kv", [0], [500])]))


def test_abort_before_the_expect_went_out_still_reaches_a_waiting_prefill(pair) -> None:
    prefill, decode, src, dst = pair
    prefill.send("early", {"kv": [1]})  # the prefill finished first and waits for the decode
    decode.expect("early", prefill.bootstrap_address, {"kv": [2]})
    decode.abort("early", "scheduler changed its mind")
    t0 = time.monotonic()
    with pytest.raises(RequestFailed, match="scheduler changed its mind"):
        decode.wait("early", WAIT)
    with pytest.raises(RequestFailed, match="scheduler changed its mind"):
        prefill.wait("early", WAIT)
    assert time.monotonic() - t0 < 1.5  # told at once, not left to its timeout


def test_abort_from_prefill_tells_decode_at_once(pair) -> None:
    prefill, decode, src, dst = pair
    before = snapshot(dst)
    decode.expect("b", prefill.bootstrap_address, {"kv": [20], "state": [2]})
    _heard(prefill, "b")
    prefill.send("b", {"kv": [3]}, last=False)
    t0 = time.monotonic()
    prefill.abort("b", "out of memory")
    with pytest.raises(RequestFailed, match="aborted by prefill: out of memory"):
        decode.wait("b", WAIT)
    with pytest.raises(RequestFailed, match="aborted by prefill: out of memory"):
        prefill.wait("b", WAIT)
    assert time.monotonic() - t0 < 1.5  # well inside the 2 s timeout
    assert decode.failure_reason("b") == "aborted by prefill: out of memory"
    # The first chunk may have landed before the abort; nothing lands after it.
    decode.release("b")
    _canary(dst, "kv", [20])
    before = snapshot(dst)
    _roundtrip(prefill, decode, "after-b", [501])
    assert_buffers(dst, expected_after(dst, before, src, [("kv", [0], [501])]))


def test_abort_racing_the_data_fails_only_that_request_and_lands_nothing_late(backend) -> None:
    # A generous grace: under load the prefill's ack must not be mistaken for a stall
    # (a fence would also cut the healthy requests this test checks are unaffected).
    cfg = config(backend, abort_grace=3.0)
    src, dst = build_pools(512, 64, seed=1), build_pools(1024, 256, seed=2)
    with PrefillEngine(src, cfg) as prefill, DecodeEngine(dst, cfg) as decode:
        finished, reused = [], []
        for i in range(20):
            rid, keep = f"race-{i}", f"keep-{i}"
            entries = list(range(64 + 8 * i, 72 + 8 * i))
            decode.expect(keep, prefill.bootstrap_address, {"kv": [600 + i]})
            decode.expect(rid, prefill.bootstrap_address, {"kv": entries})
            prefill.send(rid, {"kv": list(range(8))})
            prefill.send(keep, {"kv": [100 + i]})
            decode.abort(rid, "race")
            try:
                finished.append(decode.wait(rid, WAIT))
            except RequestFailed as exc:
                assert "race" in exc.reason
                finished.append(KVPoll.Failed)
            decode.release(rid)
            _canary(dst, "kv", entries)  # reused at once by the caller
            reused += entries
        for i in range(20):  # every aborted request's neighbour was untouched by it
            assert decode.wait(f"keep-{i}", WAIT) is KVPoll.Success
        _roundtrip(prefill, decode, "after-race", [900])
        time.sleep(0.05)
    assert KVPoll.Failed in finished
    for field in dst["kv"].fields:
        got = dst["kv"].view(field.name)[:, reused].contiguous().view(torch.uint8)
        assert bool((got == 0xA5).all()), f"a late byte landed in a reused entry ({field.name})"
        for i in range(20):
            want = src["kv"].view(field.name)[:, [100 + i]].contiguous().view(torch.uint8)
            assert torch.equal(dst["kv"].view(field.name)[:, [600 + i]].contiguous().view(torch.uint8), want)


def test_duplicate_request_ids_are_refused(pair, backend) -> None:
    prefill, decode, src, dst = pair
    decode.expect("dup", prefill.bootstrap_address, {"kv": [1]})
    with pytest.raises(RequestError, match="duplicate request id 'dup'"):
        decode.expect("dup", prefill.bootstrap_address, {"kv": [2]})
    prefill.send("dup", {"kv": [5]})
    assert decode.wait("dup", WAIT) is KVPoll.Success
    with pytest.raises(RequestError, match="already sent its last chunk"):
        prefill.send("dup", {"kv": [5]})
    # A second decode announcing an id this prefill already serves is refused by the prefill.
    other = DecodeEngine(build_pools(64, 16), config(backend))
    try:
        other.expect("dup", prefill.bootstrap_address, {"kv": [3]})
        with pytest.raises(RequestFailed, match="duplicate request id 'dup'"):
            other.wait("dup", WAIT)
    finally:
        other.close()
    # After release the id is free again on both sides.
    assert prefill.wait("dup", WAIT) is KVPoll.Success  # the decode's Done may still be on its way
    decode.release("dup")
    prefill.release("dup")
    decode.expect("dup", prefill.bootstrap_address, {"kv": [9]})
    prefill.send("dup", {"kv": [6]})
    assert decode.wait("dup", WAIT) is KVPoll.Success


def test_layout_mismatch_is_refused_with_pool_and_field_named(backend) -> None:
    wrong = [KV_FIELDS[0], layout.EntryField("v", 2, (2, 16), torch.bfloat16), KV_FIELDS[2]]
    src = build_pools(64, 16, seed=1)
    dst = build_pools(64, 16, seed=2, kv_fields=wrong)
    before = snapshot(dst)
    with PrefillEngine(src, config(backend)) as prefill, DecodeEngine(dst, config(backend)) as decode:
        prefill.send("m", {"kv": [1], "state": [1]})
        decode.expect("m", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        with pytest.raises(RequestFailed, match=r"pool 'kv': field 'v' differs in dtype: "
                                                r"torch.float16 vs torch.bfloat16") as info:
            decode.wait("m", WAIT)
        assert isinstance(info.value.__cause__, LayoutMismatchError)
        assert decode.stats("m").nbytes == 0
    assert_buffers(dst, before)


def test_stalled_prefill_times_out_on_decode_in_real_time() -> None:
    # The real-time check of this fault class (one backend): the manual-clock test below
    # covers every backend in milliseconds; this one proves the bound holds on the wall clock.
    src, dst = build_pools(64, 16), build_pools(64, 16)
    cfg = config("tcp", timeout=1.0)
    with PrefillEngine(src, cfg) as prefill, DecodeEngine(dst, cfg) as decode:
        t0 = time.monotonic()
        decode.expect("slow", prefill.bootstrap_address, {"kv": [1]})  # prefill never sends
        with pytest.raises(RequestFailed, match="timed out: no progress for 1.0 s") as info:
            decode.wait("slow", WAIT)
        elapsed = time.monotonic() - t0
        assert isinstance(info.value.__cause__, TransferTimeout)
        assert 0.9 < elapsed < 1.0 + cfg.grace + 1.0
        # Prefill-side: a send nobody expects fails after the same bound.
        t0 = time.monotonic()
        prefill.send("orphan", {"kv": [1]})
        assert prefill.poll("orphan") is KVPoll.Bootstrapping
        with pytest.raises(RequestFailed, match="no decode expected it within 1.0 s"):
            prefill.wait("orphan", WAIT)
        assert 0.9 < time.monotonic() - t0 < 2.5


def test_stalled_prefill_times_out_on_decode(backend) -> None:
    # Virtual time (pdxfer.clock.ManualClock): the bound is checked on both sides of it, on
    # every backend, without waiting it out. It is 30 s, beyond the test's real waits (WAIT),
    # so only the manual clock can reach it; the links' liveness bound is further still.
    src, dst = build_pools(64, 16), build_pools(64, 16)
    cfg = config(backend, timeout=120.0, request_timeout=30.0)
    clock = ManualClock()
    with PrefillEngine(src, cfg, clock=clock) as prefill, DecodeEngine(dst, cfg, clock=clock) as decode:
        decode.expect("slow", prefill.bootstrap_address, {"kv": [1]})  # prefill never sends
        _heard(prefill, "slow")  # so the decode's link is ready: its deadline runs from then
        clock.advance(29.99)
        settle(decode)
        assert decode.poll("slow") is KVPoll.WaitingForInput  # not before the bound
        clock.advance(0.02)
        with pytest.raises(RequestFailed, match="timed out: no progress for 30.0 s") as info:
            decode.wait("slow", WAIT)
        assert isinstance(info.value.__cause__, TransferTimeout)
        # Prefill-side: a send nobody expects fails after the same bound, not before.
        prefill.send("orphan", {"kv": [1]})
        settle(prefill)
        clock.advance(29.99)
        settle(prefill)
        assert prefill.poll("orphan") is KVPoll.Bootstrapping
        clock.advance(0.02)
        with pytest.raises(RequestFailed, match="no decode expected it within 30.0 s"):
            prefill.wait("orphan", WAIT)


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_prefill_fails_the_request_with_the_reason_in_real_time() -> None:
    # The real-time check of this fault class (one backend); every backend: the test below.
    port = _closed_port()
    with DecodeEngine(build_pools(16, 4), config("tcp")) as decode:
        decode.expect("u", f"127.0.0.1:{port}", {"kv": [1]})
        with pytest.raises(RequestFailed, match="cannot connect to prefill at 127.0.0.1"):
            decode.wait("u", WAIT)


def test_unreachable_prefill_fails_the_request_with_the_reason(backend) -> None:
    # The dial window and its backoff run on the engine clock: virtual time steps through
    # the retries (each a real, refused connect) to the end of a window only it can reach.
    port = _closed_port()
    clock = ManualClock()
    cfg = config(backend, timeout=120.0, connect_timeout=30.0)
    with DecodeEngine(build_pools(16, 4), cfg, clock=clock) as decode:
        decode.expect("u", f"127.0.0.1:{port}", {"kv": [1]})
        for _ in range(200):
            settle(decode)
            if decode.poll("u") is KVPoll.Failed:
                break
            clock.advance(0.5)
        with pytest.raises(RequestFailed, match="cannot connect to prefill at 127.0.0.1"):
            decode.wait("u", WAIT)


def test_prefill_fails_a_request_the_decode_never_confirms_in_real_time(monkeypatch) -> None:
    # The real-time check of this fault class (one backend); every backend: the test below.
    src, dst = build_pools(64, 16), build_pools(64, 16)
    cfg = config("tcp", timeout=1.0)
    with PrefillEngine(src, cfg) as prefill, DecodeEngine(dst, cfg) as decode:
        heard = prefill._on_message  # a decode whose Done is lost on the way

        def deaf(link, msg):
            if not isinstance(msg, Done):
                heard(link, msg)

        monkeypatch.setattr(prefill, "_on_message", deaf)
        decode.expect("mute", prefill.bootstrap_address, {"kv": [1]})
        prefill.send("mute", {"kv": [2]})
        assert decode.wait("mute", WAIT) is KVPoll.Success
        with pytest.raises(RequestFailed, match="decode did not confirm the data within 1.0 s"):
            prefill.wait("mute", WAIT)
        assert decode.poll("mute") is KVPoll.Success  # the prefill's late Abort changes nothing


def test_prefill_fails_a_request_the_decode_never_confirms(backend, monkeypatch) -> None:
    src, dst = build_pools(64, 16), build_pools(64, 16)
    cfg = config(backend, timeout=120.0, request_timeout=30.0)  # reached only by the manual clock
    clock = ManualClock()
    with PrefillEngine(src, cfg, clock=clock) as prefill, DecodeEngine(dst, cfg, clock=clock) as decode:
        heard = prefill._on_message  # a decode whose Done is lost on the way

        def deaf(link, msg):
            if not isinstance(msg, Done):
                heard(link, msg)

        monkeypatch.setattr(prefill, "_on_message", deaf)
        decode.expect("mute", prefill.bootstrap_address, {"kv": [1]})
        prefill.send("mute", {"kv": [2]})
        assert decode.wait("mute", WAIT) is KVPoll.Success
        # The confirm window opens once the prefill sees its transfer land (a real event it
        # polls), so virtual time moves in steps of just over the bound until it expires.
        for _ in range(20):
            settle(prefill)
            if prefill.poll("mute") is KVPoll.Failed:
                break
            clock.advance(30.01)
        with pytest.raises(RequestFailed, match="decode did not confirm the data within 30.0 s"):
            prefill.wait("mute", WAIT)
        assert decode.poll("mute") is KVPoll.Success  # the prefill's late Abort changes nothing


def test_prefill_dying_mid_send_fails_decode_requests_and_a_restart_serves_the_next(backend) -> None:
    src, dst = build_pools(256, 16, seed=1), build_pools(256, 16, seed=2)
    cfg = config(backend)
    prefill = PrefillEngine(src, cfg)
    addr = prefill.bootstrap_address
    port = int(addr.rsplit(":", 1)[1])
    decode = DecodeEngine(dst, cfg)
    try:
        for i in range(8):
            decode.expect(f"k{i}", addr, {"kv": list(range(16 * i, 16 * i + 16)), "state": [i]})
        for i in range(4):  # half are sent; the rest never will be
            prefill.send(f"k{i}", {"kv": list(range(16)), "state": [0]})
        t0 = time.monotonic()
        prefill.close()
        outcomes = {}
        for i in range(8):
            try:
                outcomes[i] = decode.wait(f"k{i}", WAIT)
            except RequestFailed as exc:
                outcomes[i] = exc.reason
        assert time.monotonic() - t0 < cfg.timeout + cfg.grace + 1.0
        for i in range(4, 8):
            assert isinstance(outcomes[i], str) and ("prefill" in outcomes[i]), outcomes[i]
        for i in range(8):
            decode.release(f"k{i}")  # the entries are free again
        # A new prefill on the same port serves the next request through a fresh link.
        prefill = PrefillEngine(src, config(backend, port=port))
        assert prefill.bootstrap_address == addr
        before = snapshot(dst)
        decode.expect("next", addr, {"kv": list(range(16)), "state": [0]})
        prefill.send("next", {"kv": list(range(100, 116)), "state": [5]})
        assert decode.wait("next", WAIT) is KVPoll.Success
        assert_buffers(dst, expected_after(dst, before, src, [("kv", list(range(100, 116)), list(range(16))),
                                                             ("state", [5], [0])]))
    finally:
        decode.close()
        prefill.close()


def test_decode_dying_fails_the_prefills_requests(backend) -> None:
    src, dst = build_pools(64, 16), build_pools(64, 16)
    cfg = config(backend)
    with PrefillEngine(src, cfg) as prefill:
        decode = DecodeEngine(dst, cfg)
        decode.expect("c1", prefill.bootstrap_address, {"kv": [1, 2]})
        decode.expect("c2", prefill.bootstrap_address, {"kv": [3]})
        _heard(prefill, "c1")
        _heard(prefill, "c2")
        prefill.send("c1", {"kv": [1]}, last=False)  # in flight: one chunk of two
        t0 = time.monotonic()
        decode.close()
        with pytest.raises(RequestFailed, match="decode engine closed"):
            prefill.wait("c1", WAIT)
        assert time.monotonic() - t0 < cfg.timeout + cfg.grace + 1.0
        prefill.release("c1")
        # c2 was never sent: the prefill forgot it, and a late send fails at once with why.
        prefill.send("c2", {"kv": [4]})
        with pytest.raises(RequestFailed, match="decode engine closed"):
            prefill.wait("c2", 1.0)
        # A healthy decode is served afterwards. Its link is a cold one (a nixl handshake on a
        # busy host outran 2 s once): a liveness bound it cannot miss, and the send only once
        # the prefill heard the Expect, so neither side's short wait covers the handshake.
        with DecodeEngine(build_pools(64, 16), config(backend, timeout=10.0)) as decode2:
            decode2.expect("c3", prefill.bootstrap_address, {"kv": [5]})
            _heard(prefill, "c3")
            prefill.send("c3", {"kv": [6]})
            assert decode2.wait("c3", WAIT) is KVPoll.Success


def test_close_is_idempotent_and_fails_what_is_running(pair) -> None:
    prefill, decode, src, dst = pair
    decode.expect("z", prefill.bootstrap_address, {"kv": [1]})
    decode.close()
    decode.close()
    assert decode.poll("z") is KVPoll.Failed
    with pytest.raises(Exception, match="closed"):
        decode.expect("z2", prefill.bootstrap_address, {"kv": [2]})
    prefill.close()
    prefill.close()


def test_bad_input_is_refused_before_anything_moves(pair) -> None:
    prefill, decode, src, dst = pair
    before = snapshot(dst)
    addr = prefill.bootstrap_address
    with pytest.raises(RequestError, match="no pool 'kvv'"):
        decode.expect("x", addr, {"kvv": [1]})
    with pytest.raises(layout.LayoutError, match="is >= the 1024 entries"):
        decode.expect("x", addr, {"kv": [1024]})
    with pytest.raises(layout.LayoutError, match="appears 2 times"):
        decode.expect("x", addr, {"kv": [3, 3]})
    with pytest.raises(RequestError, match="host:port"):
        decode.expect("x", "nowhere", {"kv": [1]})
    with pytest.raises(RequestError, match="non-empty str"):
        decode.expect("", addr, {"kv": [1]})
    with pytest.raises(RequestError, match="no pool 'nope'"):
        prefill.send("x", {"nope": [1]})
    with pytest.raises(layout.LayoutError, match="is >= the 512 entries"):
        prefill.send("x", {"kv": [512]})
    with pytest.raises(RequestError, match="unknown request id 'ghost'"):
        decode.poll("ghost")
    decode.expect("y", addr, {"kv": [1]})
    with pytest.raises(RequestError, match="is still .*; abort\\(\\) it"):
        decode.release("y")
    decode.abort("y")
    with pytest.raises(RequestFailed, match="aborted by decode: aborted"):
        decode.wait("y", WAIT)
    decode.release("y")
    assert_buffers(dst, before)  # none of the refusals above wrote a byte
