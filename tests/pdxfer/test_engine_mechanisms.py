"""The engine mechanisms the serving adapters need (#30, #31): a late Expect for a released id
fails at once, a tail-only Expect ships only the uncached tail, a decode renews a prefill's hold,
and the wire time of a request is measured apart from its end-to-end time.

Each runs over loopback and tcp (the two backends every machine has); every wait is an
event or a `wait(...)` bounded by a timeout derived from the configs, never a sleep.
"""

from __future__ import annotations

import time

import pytest
from pdxfer_testkit import build_pools, config, entries_crc

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed, TransferTimeout

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


def test_a_send_after_the_release_is_a_new_use_of_the_id(engines) -> None:
    prefill, decode, src, dst = engines
    _timed_out_and_released(prefill, "again", [1, 2])
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
