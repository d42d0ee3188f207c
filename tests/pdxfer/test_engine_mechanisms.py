"""The engine mechanisms the serving adapters need (#30, #31): a late Expect for a released id
fails at once, a tail-only Expect ships only the uncached tail, a decode renews a prefill's hold,
and the wire time of a request is measured apart from its end-to-end time.

Each runs over loopback and tcp (the two backends every machine has); every wait is an
event or a `wait(...)` bounded by a timeout derived from the configs, never a sleep.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from pdxfer.transport.errors import ProtocolError
from pdxfer_testkit import (
    assert_buffers,
    build_pools,
    config,
    entries_crc,
    expected_after,
    snapshot,
)

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestError, RequestFailed, TransferTimeout
from pdxfer.protocol import check_offsets

BACKENDS = ["loopback", "tcp"]
WAIT = 20.0


@pytest.fixture(params=BACKENDS)
def engines(request):
    """A prefill with a short request_timeout and a decode whose own is far longer than WAIT:
    a decode request that fails within WAIT failed on the prefill's word, not its own timer."""
    src = build_pools(512, 64, seed=1)
    dst = build_pools(1024, 256, seed=2)
    prefill = PrefillEngine(src, config(request.param, request_timeout=0.5))
    decode = DecodeEngine(dst, config(request.param, request_timeout=1e3))
    try:
        yield prefill, decode, src, dst
    finally:
        decode.close()
        prefill.close()


def _timed_out_and_released(prefill: PrefillEngine, rid: str, src_kv: list[int]) -> None:
    """A request sent on the prefill that no decode expected within its request_timeout."""
    prefill.send(rid, {"kv": src_kv})
    with pytest.raises(RequestFailed, match="no decode expected it"):
        prefill.wait(rid, WAIT)
    assert prefill.release(rid).state is KVPoll.Failed


# -- 1. a late Expect for an id the prefill released ------------------------------------------
def test_expect_after_release_fails_at_once_with_the_reason(engines) -> None:
    prefill, decode, _, _ = engines
    _timed_out_and_released(prefill, "late", [1, 2, 3])
    started = time.monotonic()
    decode.expect("late", prefill.bootstrap_address, {"kv": [7, 8, 9]})
    # Without the fix the prefill takes it as new and the decode waits out its 1000 s timer.
    with pytest.raises(RequestFailed, match=r"prefill already released request 'late' \(Failed: "
                                            r"request 'late': no decode expected it"):
        decode.wait("late", WAIT)
    assert time.monotonic() - started < WAIT
    # The prefill took nothing as new: no record to hold, nothing to time out later.
    assert prefill.try_poll("late") is None
    assert prefill.usage()["requests"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_send_after_the_release_is_a_new_use_of_the_id(backend) -> None:
    """Its own prefill, with a request_timeout long enough for a first handshake under load:
    the first use is aborted (never expected, so marked as released), the second is new."""
    src, dst = build_pools(512, 64, seed=1), build_pools(1024, 256, seed=2)
    with PrefillEngine(src, config(backend, request_timeout=WAIT)) as prefill, \
            DecodeEngine(dst, config(backend, request_timeout=WAIT)) as decode:
        _reused(prefill, decode, src, dst)


def _reused(prefill: PrefillEngine, decode: DecodeEngine, src: dict, dst: dict) -> None:
    prefill.send("again", {"kv": [1, 2]})
    prefill.abort("again")
    with pytest.raises(RequestFailed, match="aborted by prefill"):
        prefill.wait("again", WAIT)
    prefill.release("again")
    prefill.send("again", {"kv": [4, 5]})  # the caller reuses the id: the mark is cleared
    decode.expect("again", prefill.bootstrap_address, {"kv": [10, 11]})
    assert decode.wait("again", WAIT) is KVPoll.Success
    assert entries_crc(dst, "kv", [10, 11]) == entries_crc(src, "kv", [4, 5])


def test_a_released_success_is_not_marked(engines) -> None:
    """Only a request no decode expected is remembered: a finished pair may reuse its id
    with the Expect first, as before."""
    prefill, decode, _, _ = engines
    decode.expect("ok", prefill.bootstrap_address, {"kv": [3]})
    prefill.send("ok", {"kv": [3]})
    assert decode.wait("ok", WAIT) is KVPoll.Success
    assert prefill.wait("ok", WAIT) is KVPoll.Success
    prefill.release("ok")
    decode.release("ok")
    decode.expect("ok", prefill.bootstrap_address, {"kv": [4]})
    with pytest.raises(TransferTimeout):  # waiting for its send(), not refused
        decode.wait("ok", 0.3)
    prefill.send("ok", {"kv": [4]})
    assert decode.wait("ok", WAIT) is KVPoll.Success


# -- 2. a tail-only Expect ----------------------------------------------------------------------
SRC_KV = np.array([40, 41, 42, 43, 50, 51, 52])  # what the prefill computed and sends, in order
PREFIX = [100, 101, 102, 103]  # the decode's prefix-cache entries holding the first four already
TAIL = np.array([200, 201, 202])  # where the decode wants the three uncached ones


def test_tail_only_expect_ships_only_the_tail(engines) -> None:
    prefill, decode, src, dst = engines
    before = snapshot(dst)
    prefix_crc = entries_crc(dst, "kv", PREFIX)  # canaries: the decode's cached prefix entries
    decode.expect("tail", prefill.bootstrap_address, {"kv": TAIL, "state": [9]},
                  offsets={"kv": 4})
    prefill.send("tail", {"kv": SRC_KV, "state": [3]})
    assert decode.wait("tail", WAIT) is KVPoll.Success
    assert prefill.wait("tail", WAIT) is KVPoll.Success
    # Every byte of the decode's pools: the tail and the state entry landed, nothing else moved.
    assert_buffers(dst, expected_after(dst, before, src, [("kv", SRC_KV[4:], TAIL),
                                                          ("state", [3], [9])]))
    assert entries_crc(dst, "kv", PREFIX) == prefix_crc
    stats = decode.stats("tail")
    assert stats.nbytes == 3 * src["kv"].entry_bytes + src["state"].entry_bytes
    assert prefill.stats("tail").nbytes == stats.nbytes


def test_the_offset_spans_chunks(engines) -> None:
    """Chunked prefill: the first chunk is all prefix (nothing of it moves), the second
    starts with the prefix's last entry."""
    prefill, decode, src, dst = engines
    before = snapshot(dst)
    decode.expect("span", prefill.bootstrap_address, {"kv": TAIL}, offsets={"kv": 4})
    prefill.send("span", {"kv": SRC_KV[:3]}, last=False)
    prefill.send("span", {"kv": SRC_KV[3:]})
    assert decode.wait("span", WAIT) is KVPoll.Success
    assert_buffers(dst, expected_after(dst, before, src, [("kv", SRC_KV[4:], TAIL)]))


def test_a_fully_cached_pool_moves_nothing_of_it(engines) -> None:
    """Every entry of a pool cached (an empty tail): the request still needs its state."""
    prefill, decode, src, dst = engines
    before = snapshot(dst)
    decode.expect("all", prefill.bootstrap_address, {"kv": [], "state": [5]},
                  offsets={"kv": len(SRC_KV)})
    prefill.send("all", {"kv": SRC_KV, "state": [2]})
    assert decode.wait("all", WAIT) is KVPoll.Success
    assert_buffers(dst, expected_after(dst, before, src, [("state", [2], [5])]))


@pytest.mark.parametrize("offsets, match", [
    ({"kv": -1}, r"pool 'kv' offset must be an int count .* got -1"),
    ({"kv": True}, r"pool 'kv' offset must be an int count .* got True"),
    ({"kv": 1.5}, r"pool 'kv' offset must be an int count .* got 1.5"),
    ({"state": 2}, r"offset for pool 'state', which this Expect names no destinations in"),
    ([("kv", 1)], r"offsets must be a mapping pool -> entries"),
])
def test_bad_offsets_are_refused_before_anything_is_recorded(engines, offsets, match) -> None:
    prefill, decode, _, _ = engines
    with pytest.raises(RequestError, match=match):
        decode.expect("bad", prefill.bootstrap_address, {"kv": TAIL}, offsets=offsets)
    assert decode.try_poll("bad") is None


def test_an_offset_past_what_the_prefill_sends_is_refused_before_a_byte_moves(engines) -> None:
    prefill, decode, _, dst = engines
    before = snapshot(dst)
    decode.expect("over", prefill.bootstrap_address, {"kv": TAIL}, offsets={"kv": 9})
    until_expected(prefill, "over")
    with pytest.raises(RequestError, match=r"decode holds the first 9 entries of pool 'kv' "
                                           r"already .* this prefill sends only 7 in all"):
        prefill.send("over", {"kv": SRC_KV})
    assert_buffers(dst, before)  # refused at send(): nothing was posted
    decode.abort("over")


def until_expected(prefill: PrefillEngine, rid: str) -> None:
    """Block until the decode's Expect reached the prefill (its record waits for input)."""
    prefill_table = prefill._table  # noqa: SLF001 — a test reads the engine's condition variable
    with prefill_table.changed:
        assert prefill_table.changed.wait_for(
            lambda: prefill_table.find(rid) is not None, WAIT), f"no Expect for {rid!r}"


@pytest.mark.parametrize("offsets", [{"kv": -1}, {"kv": 0}, {"kv": True}, {"kv": "3"},
                                     {"nope": 1}, [1], {"kv": 1 << 41}])
def test_a_hostile_offsets_field_is_refused(offsets) -> None:
    with pytest.raises(ProtocolError, match="offset"):
        check_offsets(offsets, {"kv": np.zeros(1)}, "expect 'x'")


# -- 3. a decode renews the prefill's hold on a request it has queued ---------------------------
HOLD = 2.0  # the prefill's request_timeout here


@pytest.fixture(params=BACKENDS)
def holding(request):
    """A prefill whose sent requests wait HOLD s for their Expect; a decode renewing a few
    times within that (its renew_period derives from its own, shorter request_timeout)."""
    src = build_pools(512, 64, seed=1)
    dst = build_pools(1024, 256, seed=2)
    prefill = PrefillEngine(src, config(request.param, request_timeout=HOLD))
    decode = DecodeEngine(dst, config(request.param, request_timeout=0.6))
    try:
        yield prefill, decode, src, dst
    finally:
        decode.close()
        prefill.close()


def test_a_held_request_outlives_the_prefills_request_timeout(holding) -> None:
    prefill, decode, src, dst = holding
    assert decode.renew_period == pytest.approx(0.2)
    # The link first (a request through it): the handshake is not what this test times.
    decode.expect("warm", prefill.bootstrap_address, {"kv": [40]})
    prefill.send("warm", {"kv": [1]})
    assert decode.wait("warm", WAIT) is KVPoll.Success
    decode.hold("queued", prefill.bootstrap_address)
    prefill.send("queued", {"kv": [5, 6]})
    # Three of the prefill's request_timeouts pass: still waiting for its Expect, not Failed.
    # (Without the renewal it fails "no decode expected it within 2.0 s" in the first.)
    with pytest.raises(TransferTimeout):
        prefill.wait("queued", 3 * HOLD)
    assert prefill.poll("queued") is KVPoll.Bootstrapping
    decode.expect("queued", prefill.bootstrap_address, {"kv": [30, 31]})  # allocated at last
    assert decode.wait("queued", WAIT) is KVPoll.Success
    assert entries_crc(dst, "kv", [30, 31]) == entries_crc(src, "kv", [5, 6])
    assert decode.unhold("queued") is False  # the expect ended the hold


def test_an_unheld_request_times_out_on_the_prefill(holding) -> None:
    prefill, decode, _, _ = holding
    decode.hold("dropped", prefill.bootstrap_address)
    prefill.send("dropped", {"kv": [1]})
    assert decode.unhold("dropped") is True  # the decode's scheduler dropped it
    with pytest.raises(RequestFailed, match=r"no decode expected it within 2.0 s"):
        prefill.wait("dropped", WAIT)


@pytest.mark.parametrize("requests", [None, "r", [1], [""], ["x" * 1025], ["r"] * 1025])
def test_a_hostile_renew_is_refused(requests) -> None:
    from pdxfer.protocol import check_renew
    with pytest.raises(ProtocolError, match="renew: requests must be"):
        check_renew(requests)


# -- 4. wire time, apart from end-to-end ----------------------------------------------------------
GAP = 0.3  # how long the request waits before its data is posted: end-to-end, not wire


def test_wire_time_excludes_the_wait_before_the_first_write(engines) -> None:
    prefill, decode, _, _ = engines
    decode.expect("w", prefill.bootstrap_address, {"kv": list(range(300, 364)), "state": [1]})
    with pytest.raises(TransferTimeout):  # at least GAP passes before the prefill sends
        decode.wait("w", GAP)
    prefill.send("w", {"kv": list(range(64)), "state": [4]})
    assert decode.wait("w", WAIT) is KVPoll.Success
    assert prefill.wait("w", WAIT) is KVPoll.Success
    d, p = decode.stats("w"), prefill.stats("w")
    assert d.transfers == 2  # the decode's span runs from the first landed transfer to the last
    assert 0.0 <= d.wire_s and d.elapsed_s - d.wire_s >= GAP
    # The prefill's: first write posted to last write complete, within its send-to-Done.
    assert 0.0 < p.wire_s <= p.elapsed_s
    assert prefill.stats("w").wire_s == p.wire_s  # finished: it no longer grows


def test_renew_restarts_only_a_sent_requests_wait_for_its_expect() -> None:
    """The transition alone, on a scripted clock: QUEUED and sent -> deadline moves; else not."""
    from pdxfer.lifecycle import PrefillLife, Timing
    life = PrefillLife("r", Timing(wait=2.0, grace=0.3), now=0.0, local=True)
    assert life.on_renew(1.5) == [] and life.deadline == 3.5
    assert life.on_renew(1.0) == [] and life.deadline == 3.5  # never earlier
    assert life.on_tick(3.4, False) == [] and life.on_tick(3.6, False)  # times out from there
    unsent = PrefillLife("u", Timing(wait=2.0, grace=0.3), now=0.0, local=False)
    unsent.on_renew(1.0)
    assert unsent.deadline == float("inf")  # only the decode knows it: nothing to renew
