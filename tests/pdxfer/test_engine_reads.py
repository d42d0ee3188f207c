"""try_poll and failure: the two non-blocking reads a scheduler-driven adapter needs."""

from __future__ import annotations

import pytest

from pdxfer import KVPoll, RequestError, RequestFailed


def test_try_poll_is_none_for_an_unknown_id_and_the_state_otherwise(pair) -> None:
    prefill, decode, _, _ = pair
    assert prefill.try_poll("r") is None and decode.try_poll("r") is None
    with pytest.raises(RequestError):
        prefill.poll("r")  # poll keeps refusing unknown ids: try_poll is the opt-in
    decode.expect("r", prefill.bootstrap_address, {"kv": [1, 2], "state": [0]})
    assert decode.try_poll("r") in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    prefill.send("r", {"kv": [3, 4], "state": [1]})
    assert decode.wait("r", 30.0) is KVPoll.Success
    assert prefill.wait("r", 30.0) is KVPoll.Success
    assert prefill.try_poll("r") is KVPoll.Success and prefill.failure("r") is None
    prefill.release("r")
    assert prefill.try_poll("r") is None


def test_failure_is_what_wait_raises_without_blocking(pair) -> None:
    prefill, decode, _, _ = pair
    decode.expect("a", prefill.bootstrap_address, {"kv": [1], "state": [0]})
    assert decode.failure("a") is None  # running
    decode.abort("a", "scheduler gave up")
    with pytest.raises(RequestFailed) as waited:
        decode.wait("a", 30.0)
    exc = decode.failure("a")
    assert isinstance(exc, RequestFailed) and str(exc) == str(waited.value)
    assert "scheduler gave up" in exc.reason
    assert exc.__cause__ is waited.value.__cause__
    with pytest.raises(RequestError):
        decode.failure("nope")
