"""The request state machines, driven by scripted events: no sockets, no threads, no sleeps.

Every transition of `PrefillLife` and `DecodeLife` is exercised here, with
the interleavings that matter (abort before/after the Expect, a cut racing
the finish, a fence while notifies still arrive) and the three faults of
issue #8 at the machine level. Time is a number the test passes in.
"""

from __future__ import annotations

import pytest

from pdxfer import KVPoll, PeerLostError, RequestError, TransferTimeout
from pdxfer.lifecycle import (
    Cut,
    DecodeLife,
    DPhase,
    Fence,
    Finish,
    Post,
    PPhase,
    PrefillLife,
    Send,
    Timing,
)
from pdxfer.protocol import Abort, AbortAck, Done, Expect

T = Timing(wait=10.0, grace=1.0)


def kinds(effects: list) -> list[str]:
    return [type(e).__name__ for e in effects]


def finish(effects: list) -> Finish:
    found = [e for e in effects if isinstance(e, Finish)]
    assert len(found) == 1, effects
    return found[0]


def sent(effects: list) -> list:
    return [e.msg for e in effects if isinstance(e, Send)]


# -- prefill ---------------------------------------------------------------------------
def expected_prefill(ready: bool = True) -> PrefillLife:
    life = PrefillLife("r", T, 0.0, local=False)
    assert life.on_expect(7, ready, 0.0, False) == []
    assert life.phase is PPhase.EXPECTED and life.poll is KVPoll.WaitingForInput
    return life


def test_send_then_expect_posts_the_queued_chunks_in_order() -> None:
    life = PrefillLife("r", T, 0.0, local=True)
    assert life.poll is KVPoll.Bootstrapping
    assert life.on_send("c0", False, False, 0.0) == []
    assert life.on_send("c1", True, False, 0.0) == []
    effects = life.on_expect(7, True, 1.0, False)
    assert effects == [Post("c0"), Post("c1")]
    assert life.phase is PPhase.DRAINING and life.poll is KVPoll.Transferring
    assert life.on_done() == [Finish(True)]
    assert life.poll is KVPoll.Success


def test_expect_on_a_link_not_ready_waits_for_it() -> None:
    life = PrefillLife("r", T, 0.0, local=True)
    life.on_send("c0", True, False, 0.0)
    assert life.on_expect(7, False, 0.0, False) == []
    assert life.on_link_ready(0.5) == [Post("c0")]
    assert life.on_link_ready(0.6) == []  # nothing left to post


def test_a_send_after_the_last_chunk_is_refused_on_the_direct_path_too() -> None:
    """Fault 3 of #8: the post-at-once path must remember the last chunk as the queued one does."""
    life = expected_prefill()
    assert life.posts_now(True)
    assert life.on_send("c0", True, True, 0.0) == [Post("c0")]
    with pytest.raises(RequestError, match="already sent its last chunk"):
        life.on_send("again", True, True, 0.0)
    with pytest.raises(RequestError, match="already sent its last chunk"):
        life.check_send(False)
    queued = PrefillLife("q", T, 0.0, local=True)
    queued.on_send("c0", True, False, 0.0)
    with pytest.raises(RequestError, match="already sent its last chunk"):
        queued.on_send("c1", True, False, 0.0)


def test_chunks_post_at_once_only_when_nothing_is_queued_before_them() -> None:
    life = expected_prefill(ready=False)
    assert not life.posts_now(True) or life.pending == []
    assert life.on_send("c0", False, False, 0.0) == []
    assert not life.posts_now(True)  # c0 is queued: c1 must not overtake it
    assert life.on_send("c1", True, False, 0.0) == []
    assert life.on_link_ready(0.0) == [Post("c0"), Post("c1")]


def test_send_after_success_is_refused_and_after_failure_ignored() -> None:
    life = expected_prefill()
    life.on_send("c0", True, True, 0.0)
    life.on_done()
    with pytest.raises(RequestError):
        life.check_send(True)
    failed = expected_prefill()
    failed.on_abort("aborted by prefill: x", 0.0, False)
    assert failed.check_send(True) is False
    assert failed.on_send("c", True, True, 0.0) == []


def test_abort_with_nothing_in_flight_finishes_at_once_and_tells_the_decode() -> None:
    life = expected_prefill()
    effects = life.on_abort("aborted by prefill: x", 0.0, False)
    assert finish(effects) == Finish(False, "aborted by prefill: x", None)
    assert sent(effects) == [Abort("r", 7, "aborted by prefill: x", False)]
    assert life.poll is KVPoll.Failed


def test_abort_with_transfers_in_flight_waits_then_cuts_after_the_grace() -> None:
    life = expected_prefill()
    life.on_send("c0", True, True, 0.0)
    assert life.on_abort("x", 0.0, True) == []
    assert life.phase is PPhase.FAILING and life.poll is KVPoll.Transferring  # not Failed yet
    assert life.on_tick(0.5, True) == []  # within the grace
    assert life.on_tick(1.0, True) == [Cut()]
    # The driver cuts the whole connection: this request is marked, and finishes after close().
    assert life.on_link_cut("cut", 1.0, True, fenced=False) == []
    assert life.on_tick(2.0, False) == []  # close() has not returned: the source may still be read
    effects = life.on_cut_done(False)
    assert finish(effects).ok is False
    assert sent(effects) == [Abort("r", 7, "x", True)]  # fence=True: the decode must fence


def test_in_flight_transfers_that_finish_in_the_grace_end_it_clean() -> None:
    life = expected_prefill()
    life.on_send("c0", True, True, 0.0)
    life.on_abort("x", 0.0, True)
    effects = life.on_tick(0.2, False)
    assert sent(effects) == [Abort("r", 7, "x", False)]


def test_decode_abort_is_answered_with_an_ack_clean_or_cut() -> None:
    life = expected_prefill()
    life.on_send("c0", True, True, 0.0)
    assert life.on_peer_abort("aborted by decode", 0.0, True) == []
    effects = life.on_tick(0.1, False)
    assert sent(effects) == [AbortAck("r", 7, True)]
    assert finish(effects).reason == "aborted by decode"
    # A repeated Abort after the finish is answered again, with the same verdict.
    assert sent(life.on_peer_abort("again", 0.2, False)) == [AbortAck("r", 7, True)]


def test_decode_abort_before_its_expect_fails_a_queued_send() -> None:
    life = PrefillLife("r", T, 0.0, local=True)
    life.on_send("c0", True, False, 0.0)
    effects = life.on_peer_abort("aborted by decode: gone", 0.0, False)
    assert finish(effects).reason == "aborted by decode: gone"
    assert sent(effects) == []  # no xid: nothing to answer


def test_local_abort_before_the_expect_is_told_when_the_expect_comes() -> None:
    life = PrefillLife("r", T, 0.0, local=True)
    life.on_send("c0", True, False, 0.0)
    effects = life.on_abort("aborted by prefill: x", 0.0, False)
    assert finish(effects).ok is False and sent(effects) == []
    assert sent(life.on_expect(9, True, 1.0, False)) == [Abort("r", 9, "aborted by prefill: x", False)]


def test_local_abort_while_posts_fly_before_expect_never_happens_but_failing_expect_settles() -> None:
    life = PrefillLife("r", T, 0.0, local=True)
    life.on_abort("x", 0.0, True)  # a driver reporting work in flight keeps it Failing
    assert life.phase is PPhase.FAILING
    effects = life.on_expect(3, True, 0.0, False)
    assert sent(effects) == [Abort("r", 3, "x", False)]


def test_duplicate_expect_is_refused_with_the_new_xid() -> None:
    life = expected_prefill()
    assert sent(life.on_expect(8, True, 0.0, False))[0].xid == 8
    assert life.xid == 7 and life.phase is PPhase.EXPECTED


def test_deadlines_name_what_was_missing() -> None:
    for setup, what in [
        (lambda life: None, "no decode expected it"),
        (lambda life: life.on_expect(1, True, 0.0, False), "no chunk was sent for it"),
        (lambda life: (life.on_expect(1, True, 0.0, False), life.on_send("c", True, True, 0.0)),
         "decode did not confirm the data"),
    ]:
        life = PrefillLife("r", T, 0.0, local=True)
        setup(life)
        assert life.on_tick(9.9, False) == []
        effects = life.on_tick(10.0, False)
        done = finish(effects)
        assert what in done.reason and isinstance(done.error, TransferTimeout)


def test_an_expect_only_record_never_times_out_on_its_own() -> None:
    life = expected_prefill()
    assert life.on_tick(1e9, False) == []  # the decode's own wait bounds it


def test_a_posted_chunk_that_waits_for_the_next_has_no_deadline() -> None:
    life = expected_prefill()
    life.on_send("c0", False, True, 0.0)
    assert life.phase is PPhase.POSTING
    assert life.on_tick(1e9, False) == []


def test_link_lost_fails_and_waits_for_in_flight_transfers() -> None:
    life = expected_prefill()
    life.on_send("c0", True, True, 0.0)
    assert life.on_link_lost("decode lost", 0.0, True) == []
    effects = life.on_tick(0.1, False)
    assert isinstance(finish(effects).error, PeerLostError)


def test_a_fence_by_the_decode_fails_only_requests_with_transfers_in_flight() -> None:
    idle, busy = expected_prefill(), expected_prefill()
    busy.on_send("c0", True, True, 0.0)
    assert idle.on_link_cut("fenced", 0.0, False, fenced=True) == []
    assert idle.phase is PPhase.EXPECTED  # posts later on the reopened connection
    assert busy.on_link_cut("fenced", 0.0, True, fenced=True) == []
    effects = busy.on_cut_done(False)
    assert sent(effects) == [Abort("r", 7, "fenced", False)]  # the decode already fenced


def test_post_failure_and_transfer_failure_fail_the_request() -> None:
    life = expected_prefill()
    effects = life.on_post_failed("bad chunk", RequestError("bad"), 0.0, False)
    assert finish(effects).reason == "bad chunk"
    other = expected_prefill()
    other.on_send("c0", True, True, 0.0)
    effects = other.on_transfer_failed("transfer failed", PeerLostError("x"), 0.0)
    assert finish(effects).reason == "transfer failed"


def test_close_finishes_whatever_state() -> None:
    for life in (PrefillLife("a", T, 0.0, local=True), expected_prefill()):
        life.on_abort("x", 0.0, True) if life.expected else None
        effects = life.on_close("prefill engine closed", RequestError("closed"))
        assert finish(effects).ok is False
        assert life.on_close("again", RequestError("closed")) == []


def test_finish_is_returned_exactly_once_for_any_event_order() -> None:
    events = [
        lambda lf, t: lf.on_abort("a", t, False),
        lambda lf, t: lf.on_peer_abort("p", t, False),
        lambda lf, t: lf.on_link_lost("l", t, False),
        lambda lf, t: lf.on_done(),
        lambda lf, t: lf.on_tick(t, False),
        lambda lf, t: lf.on_close("c", RequestError("c")),
    ]
    for first in events:
        for second in events:
            life = expected_prefill()
            life.on_send("c0", True, True, 0.0)
            got = first(life, 20.0) + second(life, 21.0)
            assert sum(isinstance(e, Finish) for e in got) == 1, (first, second, got)
            assert not any(isinstance(e, Post) for e in got)


# -- decode --------------------------------------------------------------------------------
def announced() -> DecodeLife:
    life = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0)
    assert life.poll is KVPoll.Bootstrapping
    assert life.on_link_ready(0.0) == [Send(Expect("r", 5, {}))]
    assert life.poll is KVPoll.WaitingForInput
    return life


def test_success_needs_every_part_of_every_chunk_through_the_last() -> None:
    life = announced()
    assert life.on_landed(1, 0, 1, True, 0.1) == []  # the last chunk, but chunk 0 is missing
    assert life.poll is KVPoll.Transferring
    assert life.on_landed(0, 0, 2, False, 0.2) == []
    effects = life.on_landed(0, 1, 2, False, 0.3)
    assert effects == [Finish(True), Send(Done("r", 5))]
    assert life.on_landed(0, 1, 2, False, 0.4) == []  # nothing counts after Success


def test_an_inconsistent_notify_aborts() -> None:
    life = announced()
    life.on_landed(0, 0, 2, False, 0.0)
    effects = life.on_landed(0, 0, 3, True, 0.0)
    assert sent(effects) and isinstance(sent(effects)[0], Abort)
    assert life.phase is DPhase.ABORTING


@pytest.mark.parametrize("notifies, named", [
    # two copies of part 0 of a 2-part chunk: a count says whole, the parts say not (#29.5)
    ([(0, 0, 2, True), (0, 0, 2, True)], "part 0 of chunk 0 already landed"),
    ([(0, 2, 2, True)], "part must be in 0..parts-1"),
    ([(0, -1, 2, True)], "part must be in 0..parts-1"),
    ([(-1, 0, 1, False)], "a chunk >= 0"),
    # chunk 2 whole and chunk 0 whole: two chunks, but chunk 1 of 0..1 never came
    # chunks 2 and 0 whole, then half of chunk 1 as the last: a count of 2 whole chunks said done
    ([(2, 0, 1, False), (0, 0, 1, False), (1, 0, 2, True)], "chunk 2 landed past this last"),
    ([(0, 0, 2, True), (3, 0, 1, False)], "chunk 3 is past the last chunk 0"),
    ([(1, 0, 2, True), (0, 0, 1, True)], "chunk 1 was already the last"),
])
def test_a_notify_that_cannot_belong_to_the_request_fails_it_named(notifies, named) -> None:
    life = announced()
    effects: list = []
    for chunk, part, parts, last in notifies:
        effects += life.on_landed(chunk, part, parts, last, 0.1)
    assert not any(isinstance(e, Finish) and e.ok for e in effects), effects
    aborts = [m for m in sent(effects) if isinstance(m, Abort)]
    assert len(aborts) == 1 and named in aborts[0].reason, (aborts, named)
    assert "inconsistent notify" in aborts[0].reason
    assert life.phase is DPhase.ABORTING


def test_abort_before_the_expect_left_fails_at_once_and_is_told_on_the_handshake() -> None:
    life = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0)
    effects = life.on_abort("aborted by decode: x", 0.0)
    assert finish(effects).reason == "aborted by decode: x"
    assert life.on_link_ready(0.1) == [Send(Abort("r", 5, "aborted by decode: x", False))]
    assert life.on_link_ready(0.2) == []  # told once


def test_abort_after_the_expect_waits_for_the_ack_and_ignores_late_bytes() -> None:
    life = announced()
    assert sent(life.on_abort("x", 1.0)) == [Abort("r", 5, "x", False)]
    assert life.poll is KVPoll.WaitingForInput  # not Failed until no byte can land
    assert life.on_landed(0, 0, 1, True, 1.1) == []
    assert finish(life.on_abort_ack(True)).reason == "x"


def test_a_cut_ack_or_a_missing_ack_fences_before_failing() -> None:
    life = announced()
    life.on_abort("x", 1.0)
    assert life.on_abort_ack(False) == [Fence()]
    assert life.on_tick(100.0) == []  # fencing: the driver reports when drop_peer returned
    assert finish(life.on_fenced()).reason == "x (the prefill cut its transfers; fenced it)"
    slow = announced()
    slow.on_abort("x", 1.0)
    assert slow.on_tick(1.5) == []
    assert slow.on_tick(2.0) == [Fence()]
    assert "did not confirm the abort" in finish(slow.on_fenced()).reason


def test_prefill_abort_fences_only_when_bytes_may_fly() -> None:
    clean = announced()
    assert finish(clean.on_peer_abort("aborted by prefill: x", False)).reason == "aborted by prefill: x"
    cut = announced()
    assert cut.on_peer_abort("aborted by prefill: x", True) == [Fence()]
    assert finish(cut.on_fenced()).ok is False


def test_link_lost_fails_before_the_expect_and_fences_after() -> None:
    early = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0)
    assert finish(early.on_link_lost("lost", PeerLostError("lost"))).reason == "lost"
    late = announced()
    assert late.on_link_lost("lost", PeerLostError("lost")) == [Fence()]
    assert finish(late.on_fenced()).reason == "lost"


def test_timeout_aborts_then_fences_if_unanswered() -> None:
    life = announced()
    assert life.on_tick(9.0) == []
    effects = life.on_tick(10.0)
    assert isinstance(sent(effects)[0], Abort) and "timed out" in sent(effects)[0].reason
    assert life.on_tick(11.0) == [Fence()]
    assert isinstance(finish(life.on_fenced()).error, TransferTimeout)
    dialing = DecodeLife("d", 6, Expect("d", 6, {}), T, 0.0)
    assert finish(dialing.on_tick(10.0)).ok is False


def test_decode_close_tells_the_prefill_only_what_it_knows() -> None:
    life = announced()
    effects = life.on_close("decode engine closed", RequestError("closed"))
    assert sent(effects) == [Abort("r", 5, "decode engine closed", False)]
    dialing = DecodeLife("d", 6, Expect("d", 6, {}), T, 0.0)
    assert sent(dialing.on_close("closed", RequestError("closed"))) == []


def test_decode_finishes_exactly_once_for_any_event_order() -> None:
    events = [
        lambda lf, t: lf.on_abort("a", t),
        lambda lf, t: lf.on_abort_ack(True),
        lambda lf, t: lf.on_abort_ack(False),
        lambda lf, t: lf.on_peer_abort("p", False),
        lambda lf, t: lf.on_peer_abort("p", True),
        lambda lf, t: lf.on_link_lost("l", PeerLostError("l")),
        lambda lf, t: lf.on_landed(0, 0, 1, True, t),
        lambda lf, t: lf.on_tick(t),
        lambda lf, t: lf.on_fenced(),
        lambda lf, t: lf.on_close("c", RequestError("c")),
    ]
    for a in events:
        for b in events:
            for c in events:
                life = announced()
                got = a(life, 20.0) + b(life, 40.0) + c(life, 60.0)
                got += life.on_fenced()  # the driver always reports a requested fence
                assert sum(isinstance(e, Finish) for e in got) <= 1, (got,)
                if any(isinstance(e, Finish) for e in got):
                    assert life.finished
