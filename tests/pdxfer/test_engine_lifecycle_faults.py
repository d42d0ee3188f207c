"""Issue #8's control-plane faults, in one process over every backend (tcp, nixl, loopback).

- a fenced data connection must not be reused: the next request after a
  fence succeeds;
- `send()` after the last chunk is refused even when that chunk was posted
  at once (the state machine's rule, here through the engines);
- the prefill sees what the decode expects and aborts, with reasons;
- ids that cannot cross the wire are refused up front and fail no other request.

The cross-process variants (a SIGSTOPped decode or prefill) are in
`test_engine_stall.py`.
"""

from __future__ import annotations

import time

import pytest
from pdxfer_testkit import build_pools, config, until
from pdxfer_testkit import poll_or_none as _poll

from pdxfer import (
    DecodeEngine,
    KVPoll,
    PrefillEngine,
    RequestError,
    RequestFailed,
    UnknownRequestError,
)
from pdxfer.protocol import Abort

WAIT = 20.0


def test_send_after_a_last_chunk_posted_at_once_is_refused(pair) -> None:
    prefill, decode, _, _ = pair
    decode.expect("r", prefill.bootstrap_address, {"kv": [1, 2]})
    until(lambda: _poll(prefill, "r") is KVPoll.WaitingForInput, "the prefill sees the Expect")
    prefill.send("r", {"kv": [3, 4]}, last=True)  # posted directly, not queued
    with pytest.raises(RequestError, match="already sent its last chunk"):
        prefill.send("r", {}, last=True)  # moves nothing: only the state machine can refuse it
    with pytest.raises(RequestError, match="already sent its last chunk"):
        prefill.send("r", {"kv": [5, 6]}, last=True)
    assert decode.wait("r", WAIT) is KVPoll.Success
    assert prefill.wait("r", WAIT) is KVPoll.Success
    assert prefill.stats("r") == prefill.stats("r")
    assert decode.stats("r").transfers == prefill.stats("r").transfers == 1


def test_the_next_request_after_a_fence_succeeds(backend, monkeypatch) -> None:
    """The decode fences the prefill (its abort went unanswered); the next request must not
    be posted on the fenced data connection ("Broken pipe")."""
    src, dst = build_pools(64, 16, seed=1), build_pools(64, 16, seed=2)
    with PrefillEngine(src, config(backend)) as prefill, DecodeEngine(dst, config(backend)) as decode:
        decode.expect("warm", prefill.bootstrap_address, {"kv": [1]})
        prefill.send("warm", {"kv": [1]})
        assert decode.wait("warm", WAIT) is KVPoll.Success
        heard = prefill._on_message

        def deaf(link, msg):  # a prefill that does not answer Aborts for a while
            if not isinstance(msg, Abort):
                heard(link, msg)

        monkeypatch.setattr(prefill, "_on_message", deaf)
        link = next(iter(prefill._links))
        link._on_message = deaf
        # The race the fix is for: the prefill's transport has not yet noticed that the fence
        # killed its connection (its reader is behind), so the connection still looks alive
        # until the prefill itself closes it. Only the decode's Fenced message tells it.
        stale = link.owner.conn
        real_alive, real_close, closed = type(stale).alive, stale.close, []

        def close_stale():
            closed.append(True)
            real_close()

        monkeypatch.setattr(stale, "close", close_stale)
        monkeypatch.setattr(type(stale), "alive", property(
            lambda conn: real_alive.fget(conn) or (conn is stale and not closed)))
        decode.expect("doomed", prefill.bootstrap_address, {"kv": [2]})
        until(lambda: _poll(prefill, "doomed") is KVPoll.WaitingForInput, "the prefill sees the Expect")
        decode.abort("doomed")
        with pytest.raises(RequestFailed, match="fenced it"):
            decode.wait("doomed", WAIT)
        link._on_message = heard
        for i in range(3):
            rid = f"after{i}"
            decode.expect(rid, prefill.bootstrap_address, {"kv": [10 + i], "state": [i]})
            prefill.send(rid, {"kv": [20 + i], "state": [i]})
            assert decode.wait(rid, WAIT) is KVPoll.Success, decode.failure_reason(rid)
            assert prefill.wait(rid, WAIT) is KVPoll.Success


def test_prefill_sees_expected_and_aborted_requests_with_reasons(pair) -> None:
    prefill, decode, _, _ = pair
    with pytest.raises(UnknownRequestError):
        prefill.poll("seen")  # not expected yet: told apart without parsing text
    decode.expect("seen", prefill.bootstrap_address, {"kv": [1]})
    until(lambda: _poll(prefill, "seen") is KVPoll.WaitingForInput, "the prefill sees the Expect")
    decode.abort("seen", "client went away")
    until(lambda: prefill.poll("seen") is KVPoll.Failed, "the prefill sees the abort")
    assert "client went away" in prefill.failure_reason("seen")
    outcome = prefill.release("seen")
    assert outcome.state is KVPoll.Failed and "client went away" in outcome.reason
    with pytest.raises(UnknownRequestError):
        prefill.poll("seen")


def test_abort_before_the_expect_left_reaches_a_sending_prefill_in_one_round_trip(pair) -> None:
    prefill, decode, _, _ = pair
    prefill.send("early", {"kv": [1]})  # the prefill is waiting for an Expect
    decode.expect("early", prefill.bootstrap_address, {"kv": [1]})
    decode.abort("early", "gone")  # before (or just after) the Expect left
    t0 = time.monotonic()
    with pytest.raises(RequestFailed, match="gone"):
        prefill.wait("early", WAIT)
    # Well inside the request wait (2 s): told by a message, not found by a timeout.
    assert time.monotonic() - t0 < prefill.config.request_wait


@pytest.mark.parametrize("bad", ["x" * (5 << 20), "bad\ud800id", "", 7])
def test_ids_that_cannot_cross_the_wire_are_refused_up_front(pair, bad) -> None:
    prefill, decode, _, _ = pair
    decode.expect("good", prefill.bootstrap_address, {"kv": [1]})  # shares the handshake
    with pytest.raises(RequestError, match="request id|non-empty str"):
        decode.expect(bad, prefill.bootstrap_address, {"kv": [2]})
    with pytest.raises(RequestError, match="request id|non-empty str"):
        prefill.send(bad, {"kv": [2]})
    prefill.send("good", {"kv": [3]})
    assert decode.wait("good", WAIT) is KVPoll.Success
    assert prefill.wait("good", WAIT) is KVPoll.Success


def test_the_id_limit_is_named() -> None:
    from pdxfer.requests import MAX_ID_BYTES, check_request_id

    assert check_request_id("é" * (MAX_ID_BYTES // 2)) == "é" * (MAX_ID_BYTES // 2)
    with pytest.raises(RequestError, match=f"exceeds the {MAX_ID_BYTES}-byte limit"):
        check_request_id("é" * (MAX_ID_BYTES // 2 + 1))
    with pytest.raises(RequestError, match="not valid UTF-8"):
        check_request_id("bad\ud800id")
