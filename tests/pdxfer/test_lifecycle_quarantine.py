"""The quarantine rule (#11) in the pure state machines: no sockets, no threads, no sleeps.

A decode whose transport cannot fence (`DecodeLife(..., fence=False)`) never
reports Failed while a byte of the request may still land: every arrow that
would fence goes to QUARANTINED (the prefill is alive and will answer) or
ORPHANED (the control link is gone; only the transport can tell the prefill
is gone). Every transition into and out of both is driven here, and an
exhaustive check pins which events alone may release a quarantine.

Since #25.1 the prefill's word is not enough when it names data links that
were closed with transfers of the request on them (`links`): a close is not
a fence, bytes sent before it may still land, so the request stays
QUARANTINED until the driver saw the transport report each settled
(`on_quiet`).
"""

from __future__ import annotations

import itertools

from pdxfer import KVPoll, PeerLostError, RequestError, TransferTimeout
from pdxfer.lifecycle import (
    DecodeLife,
    DPhase,
    Fence,
    Finish,
    PPhase,
    PrefillLife,
    Quarantine,
    Send,
    Timing,
)
from pdxfer.protocol import Abort, AbortAck, Expect

T = Timing(wait=10.0, grace=1.0)


def expected(fence: bool = False) -> DecodeLife:
    life = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0, fence=fence)
    assert life.on_link_ready(0.0) == [Send(Expect("r", 5, {}))]
    return life


def only(effects: list, kind: type):
    found = [e for e in effects if isinstance(e, kind)]
    assert len(found) == 1 and len(effects) == 1, effects
    return found[0]


def quarantined_after_timeout() -> DecodeLife:
    life = expected()
    life.on_landed(0, 0, 2, False, 1.0)  # part of it landed: the prefill is writing
    abort = life.on_tick(11.0)
    assert [type(e) for e in abort] == [Send] and isinstance(abort[0].msg, Abort)
    assert life.phase is DPhase.ABORTING and life.poll is KVPoll.Transferring
    held = only(life.on_tick(12.0), Quarantine)  # no AbortAck within the grace, and no fence
    assert life.phase is DPhase.QUARANTINED and life.poll is KVPoll.Quarantined
    assert "timed out" in held.reason and "quarantined until it does" in held.reason
    assert isinstance(held.error, TransferTimeout)
    return life


def test_an_unanswered_abort_quarantines_instead_of_fencing_and_waits_for_the_ack() -> None:
    life = quarantined_after_timeout()
    assert life.on_tick(1e9) == []  # no deadline ends a quarantine
    assert life.on_landed(0, 1, 2, True, 13.0) == []  # late bytes count for nothing
    assert life.on_abort("caller again", 13.0) == []
    assert life.on_peer_gone() == []  # the link lives: the prefill is asked, not guessed at
    assert not life.finished and life.poll is KVPoll.Quarantined
    done = only(life.on_abort_ack(True), Finish)
    assert done.ok is False and isinstance(done.error, TransferTimeout)
    assert done.reason.endswith("(the prefill confirmed its transfers ended)")
    assert life.phase is DPhase.FAILED and life.poll is KVPoll.Failed


def test_a_cut_ack_ends_a_quarantine_too_and_never_fences() -> None:
    life = quarantined_after_timeout()
    assert only(life.on_abort_ack(False), Finish).reason.endswith(
        "(the prefill cut its transfers and confirmed it)")
    aborting = expected()
    aborting.on_abort("x", 1.0)
    assert only(aborting.on_abort_ack(False), Finish).reason == "x (the prefill cut its transfers and confirmed it)"


def test_the_prefills_own_abort_is_its_word_that_nothing_flies() -> None:
    cut = expected()
    assert only(cut.on_peer_abort("aborted by prefill: x", True), Finish).reason == "aborted by prefill: x"
    held = quarantined_after_timeout()
    assert only(held.on_peer_abort("prefill gave up", True), Finish).reason.endswith(
        "(the prefill confirmed its transfers ended)")


def test_a_lost_link_orphans_the_request_until_the_prefill_is_gone() -> None:
    for setup in ("expected", "receiving", "aborting", "quarantined"):
        life = quarantined_after_timeout() if setup == "quarantined" else expected()
        if setup == "receiving":
            life.on_landed(0, 0, 2, False, 1.0)
        elif setup == "aborting":
            life.on_abort("x", 1.0)
        held = only(life.on_link_lost("control link lost", PeerLostError("lost")), Quarantine)
        assert life.phase is DPhase.ORPHANED and life.poll is KVPoll.Quarantined, setup
        assert "data connections closed" in held.reason
        assert life.on_link_lost("again", PeerLostError("again")) == []
        assert life.on_abort_ack(True) == [] and life.on_peer_abort("p", False) == []
        assert life.on_tick(1e9) == [] and life.on_abort("x", 2.0) == []
        done = only(life.on_peer_gone(), Finish)
        assert done.ok is False and "connections are closed" in done.reason, setup
        assert life.on_peer_gone() == []


def test_before_the_expect_nothing_can_land_so_nothing_is_quarantined() -> None:
    life = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0, fence=False)
    assert only(life.on_link_lost("lost", PeerLostError("lost")), Finish).reason == "lost"
    timed = DecodeLife("t", 6, Expect("t", 6, {}), T, 0.0, fence=False)
    assert only(timed.on_tick(10.0), Finish).ok is False


def test_close_ends_a_quarantine_the_transport_is_down() -> None:
    for life in (quarantined_after_timeout(), expected()):
        if life.phase is DPhase.EXPECTED:
            life.on_link_lost("lost", PeerLostError("lost"))
        assert only(life.on_close("decode engine closed", RequestError("closed")), Finish).ok is False


def test_a_fenceable_transport_keeps_fencing_and_never_quarantines() -> None:
    life = expected(fence=True)
    assert life.on_link_lost("lost", PeerLostError("lost")) == [Fence()]
    assert life.on_peer_gone() == []


# The events a decode request can see, tagged by whether they carry proof that
# no byte of it can land any more (the prefill's word, the prefill gone, close).
EVENTS = {
    "abort": (False, lambda lf, t: lf.on_abort("a", t)),
    "ack_clean": (True, lambda lf, t: lf.on_abort_ack(True)),
    "ack_cut": (True, lambda lf, t: lf.on_abort_ack(False)),
    "peer_abort": (True, lambda lf, t: lf.on_peer_abort("p", False)),
    "peer_abort_cut": (True, lambda lf, t: lf.on_peer_abort("p", True)),
    "link_lost": (False, lambda lf, t: lf.on_link_lost("l", PeerLostError("l"))),
    "peer_gone": (True, lambda lf, t: lf.on_peer_gone()),
    "landed": (False, lambda lf, t: lf.on_landed(0, 0, 2, False, t)),
    "tick": (False, lambda lf, t: lf.on_tick(t)),
    "fenced": (False, lambda lf, t: lf.on_fenced()),
    "close": (True, lambda lf, t: lf.on_close("c", RequestError("c"))),
    # The word naming closed links is no proof until they settled (#25.1).
    "ack_cut_links": (False, lambda lf, t: lf.on_abort_ack(False, ["L"])),
    "ack_clean_links": (False, lambda lf, t: lf.on_abort_ack(True, ["L"])),
    "peer_abort_links": (False, lambda lf, t: lf.on_peer_abort("p", True, ["L"])),
    "quiet": (True, lambda lf, t: lf.on_quiet()),
}


def test_without_a_fence_only_proof_that_nothing_flies_fails_a_request_the_prefill_writes() -> None:
    for names in itertools.product(EVENTS, repeat=3):
        life = expected()
        life.on_landed(0, 0, 2, False, 1.0)  # the prefill is writing from here on
        finishes = 0
        for step, name in enumerate(names):
            proof, event = EVENTS[name]
            got = event(life, 20.0 * (step + 1))
            assert not any(isinstance(e, Fence) for e in got), (names, got)
            if any(isinstance(e, Finish) for e in got):
                finishes += 1
                assert proof, f"{names}: {name} failed the request without proof: {got}"
            if any(isinstance(e, Quarantine) for e in got):
                assert life.poll is KVPoll.Quarantined and not life.finished
        assert finishes <= 1, names
        assert life.finished == (finishes == 1), names


def test_the_prefill_sends_its_word_only_once_nothing_of_the_request_flies() -> None:
    # The other half of the rule: the prefill's Abort/AbortAck, which end a
    # quarantine, leave only when no handle is in flight and no cut is running.
    life = PrefillLife("r", T, 0.0, local=False)
    life.on_expect(7, True, 0.0, False)
    life.on_send("c0", True, True, 0.0)
    assert life.on_peer_abort("decode gave up", 1.0, inflight=True) == []
    assert life.on_tick(1.5, inflight=True) == []
    cut = life.on_tick(2.0, inflight=True)
    assert [type(e).__name__ for e in cut] == ["Cut"]
    assert life.on_link_cut("cut", 2.0, True, fenced=False) == []
    assert life.on_tick(2.5, inflight=True) == []  # the close has not returned yet
    effects = life.on_cut_done(inflight=False)
    assert life.phase is PPhase.FAILED
    assert [e.msg for e in effects if isinstance(e, Send)] == [AbortAck("r", 7, False)]


# -- the word names closed data links: Failed only once the transport shows them settled (#25.1) --

def test_a_cut_ack_naming_links_holds_the_request_until_they_settle() -> None:
    life = quarantined_after_timeout()
    held = only(life.on_abort_ack(False, ["L1", "L2"]), Quarantine)
    assert life.phase is DPhase.QUARANTINED and life.poll is KVPoll.Quarantined
    assert life.links == {"L1", "L2"} and "L1, L2 settled" in held.reason
    assert "the prefill cut its transfers and confirmed it" in held.reason
    assert life.on_abort_ack(True) == [] and life.on_peer_abort("p", False) == []  # no undoing
    assert life.on_abort_ack(False, ["L3"]) == [] and life.links == {"L1", "L2", "L3"}
    assert life.on_tick(1e9) == [] and life.on_peer_gone() == []
    done = only(life.on_quiet(), Finish)
    assert done.ok is False and done.reason.endswith("(the prefill cut its transfers and confirmed it)")
    assert life.on_quiet() == [] and life.poll is KVPoll.Failed


def test_every_word_of_the_prefill_naming_links_waits_for_them() -> None:
    words = {"clean ack": lambda lf: lf.on_abort_ack(True, ["L"]),
             "its abort, cut": lambda lf: lf.on_peer_abort("p", True, ["L"]),
             "its abort": lambda lf: lf.on_peer_abort("p", False, ["L"])}
    for name, word in words.items():
        for aborted in (False, True) if "abort" in name else (True,):  # an ack answers our Abort
            life = expected()
            life.on_landed(0, 0, 2, False, 1.0)
            if aborted:
                life.on_abort("x", 2.0)
            only(word(life), Quarantine)
            assert life.poll is KVPoll.Quarantined and life.links == {"L"}, (name, aborted)
            assert only(life.on_quiet(), Finish).ok is False
    # "" names every link of the prefill (a backend that cannot name one)
    life = expected()
    assert "every link settled" in only(life.on_peer_abort("p", True, [""]), Quarantine).reason


def test_a_lost_link_while_waiting_for_links_orphans_it() -> None:
    life = quarantined_after_timeout()
    life.on_abort_ack(False, ["L"])
    only(life.on_link_lost("lost", PeerLostError("lost")), Quarantine)
    assert life.phase is DPhase.ORPHANED and life.on_quiet() == []
    assert only(life.on_peer_gone(), Finish).ok is False


def test_quiet_means_nothing_without_named_links() -> None:
    assert quarantined_after_timeout().on_quiet() == []
    assert expected().on_quiet() == []


def test_with_a_fence_a_cut_still_fences_and_closed_links_are_waited_for() -> None:
    life = expected(fence=True)
    life.on_abort("x", 1.0)
    assert life.on_abort_ack(False, ["L"]) == [Fence()]  # the fence covers every link
    clean = expected(fence=True)
    clean.on_abort("x", 1.0)
    only(clean.on_abort_ack(True, ["L"]), Quarantine)  # a transfer failed on a closed link
    assert only(clean.on_quiet(), Finish).ok is False


def test_the_prefill_names_every_link_it_posted_on_but_its_live_one() -> None:
    from types import SimpleNamespace

    from pdxfer.chunks import closed_links
    from pdxfer.protocol import MAX_LINKS

    conn = SimpleNamespace(incarnation="live", alive=True)
    session = SimpleNamespace(conn=conn, ready=True)
    req = SimpleNamespace(session=session, links={"old", "live", "older"})
    assert closed_links(req) == ["old", "older"]
    session.ready = False  # cut: its close returned, the reopen has not
    assert closed_links(req) == ["live", "old", "older"]
    req.links = {f"l{i}" for i in range(MAX_LINKS + 1)}
    assert closed_links(req) == [""]  # too many to name: every link
