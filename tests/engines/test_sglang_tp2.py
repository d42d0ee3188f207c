"""Decode TP 2 as SGLang runs it: two decode processes in a real gloo group, one rank failing.

SGLang MIN-reduces the ranks' polls, so when one decode rank's transfer
fails every rank sees Failed and frees its pages; a sibling rank's transfer
may still be live then, its prefill still writing. SGLang's deferred decode
KV release holds the pages (MAX-reduced) until every rank's manager says
nothing more can land (`is_abort_release_safe`). These tests check that
pdxfer answers it exactly: each decode process plays the pages' next owner,
writing a canary over them the instant SGLang frees them and recording
pdxfer's state of the request then; once the prefill's last write is over,
the canaries must be intact and no rank freed a page pdxfer still held.

Processes: prefill TP rank 0 (with SGLang's bootstrap server) and TP rank 1
in separate processes (so one can die alone), and two decode ranks, each
with two managers: `tcp` (fences; liveness 2 s) and `nofence` (tcp with
`fence=False`: a failed request is Quarantined until pdxfer has proof that
nothing flies, as on a one-sided transport that cannot fence; liveness
10 s, so that rank 1's prefill frozen for the `tcp` case, fenced there and
resumed, keeps its `nofence` link; the `nofence` case then kills it).
"""

from __future__ import annotations

import os
import signal
import tempfile

import pytest
from sglang_procs import PrefillProc, Proc

# Four processes import SGLang in parallel in the fixture: about a minute on an idle 2-core
# machine, past 480 s measured at load average 20 to 25 (other suites running).
pytestmark = pytest.mark.timeout(900)
N, SRC, ENDS = 40, [2, 11, 5], [20, 40]
SAFE = (None, "Failed", "Success")  # pdxfer states in which nothing more can land


@pytest.fixture(scope="module")
def group():
    """The prefill's two TP ranks (each its own process) and the two decode ranks."""
    init = tempfile.mktemp(prefix="pdxfer-gloo-")
    a = PrefillProc(ranks=[0])
    # rank 1 registers with rank 0's server, which may still be importing SGLang: its
    # registration retries for bootstrap_wait = timeout + connect_timeout
    # liveness 10 s (heartbeats 0.5 s): frozen and resumed in the `tcp` case, it must keep its
    # link to the `nofence` decode, which the `nofence` case needs
    b = PrefillProc(ranks=[1], port=a.port, config={"timeout": 10.0, "heartbeat_interval": 0.5,
                                                    "request_timeout": 30.0,
                                                    "connect_timeout": 300.0})
    decodes = [Proc("sglang_decode_proc.py", [str(r), "2", init]) for r in (0, 1)]
    started = [a, b, *decodes]
    try:
        for p in started:
            assert p.read() == {"ready": True}
        yield {"tcp": [a, b], "nofence": [a, b]}, decodes
    finally:
        for p in started:
            if p.proc.poll() is None:
                p.proc.kill()
            p.proc.wait(30)


def _start(pairs, decodes, key: str, room: int, modes: tuple[str, str]) -> None:
    """Both prefill ranks serve `room` (modes per rank), both decode ranks admit and allocate it."""
    for rank, (proc, mode) in enumerate(zip(pairs[key], modes, strict=True)):
        proc.write(rank=rank, room=room, n=N, src=SRC, ends=ENDS, token=7, mode=mode)
    for d in decodes:
        d.write(op="admit", key=key, room=room, n=N, port=pairs[key][0].port, dst=[40, 41, 42])
    assert [d.read() for d in decodes] == [{"admitted": room}] * 2
    for proc in pairs[key]:
        assert proc.read()["phase"] == "sent-first"  # the first chunk landed on both ranks


def _done(d: Proc) -> dict:
    """A decode rank's `run` result, past its phase events (a no-fence abort is Quarantined too)."""
    while "phase" in (ev := d.read()):
        pass
    return ev


def _check(decodes, key: str, room: int, done: list[dict]) -> None:
    for rank, ev in enumerate(done):
        assert ev["finished"] == "FINISH_ABORT", ev
        assert ev["releases"] == 1, ev  # SGLang freed the pages once, on each rank
        assert all(s in SAFE for s in ev["at_release"]), (rank, ev)
    for d in decodes:
        d.write(op="check", key=key, room=room)
    assert [d.read() for d in decodes] == [{"canary": True}] * 2, "a page changed after SGLang freed it"


@pytest.mark.parametrize("key", ["tcp", "nofence"])
def test_one_decode_rank_aborting_holds_every_ranks_pages_until_nothing_can_land(group, key) -> None:
    pairs, decodes = group
    room = {"tcp": 7001, "nofence": 7002}[key]
    _start(pairs, decodes, key, room, ("step", "step"))
    decodes[0].write(op="abort", key=key, room=room)
    assert decodes[0].read() == {"aborted": room}
    for d in decodes:
        d.write(op="run", key=key, room=room)
    done = [_done(d) for d in decodes]
    for proc in pairs[key]:  # the prefill's forward finishes: its last chunks, if any, go now
        proc.write()
    finished = [proc.read() for proc in pairs[key]]
    _check(decodes, key, room, done)
    assert [f["finished"] for f in finished] == ["FINISH_ABORT"] * 2, finished  # rank 1 aborted too
    # rank 1 failed only because rank 0 did: SGLang is told so (it logs it at debug)
    assert "another decode rank" in done[1]["message"], done[1]


@pytest.mark.parametrize("key", ["tcp", "nofence"])  # in this order: the second kills rank 1
def test_one_ranks_prefill_dying_mid_transfer_frees_no_page_a_sibling_can_still_write(group, key) -> None:
    pairs, decodes = group
    room = {"tcp": 7101, "nofence": 7102}[key]
    live, doomed = pairs[key]
    _start(pairs, decodes, key, room, ("step", "die"))
    os.kill(doomed.proc.pid, signal.SIGSTOP)  # frozen: its sockets stay open, nothing acks
    try:
        for d in decodes:
            d.write(op="run", key=key, room=room)
        if key == "nofence":
            # rank 1's transfer is Quarantined (the frozen prefill may still write): nothing is
            # freed on either rank while it is; the kill is what proves nothing flies
            assert decodes[1].read() == {"phase": "quarantined", "room": room}
            os.kill(doomed.proc.pid, signal.SIGKILL)
        done = [_done(d) for d in decodes]  # tcp: rank 1 fenced its frozen prefill at 2 s
    finally:
        if doomed.proc.poll() is None:
            os.kill(doomed.proc.pid, signal.SIGCONT)
    if key == "tcp":  # resumed, it finds itself fenced: its last chunk lands nowhere either
        doomed.write()
        assert doomed.read()["finished"] == "FINISH_ABORT"
    assert "another decode rank" in done[0]["message"], done[0]
    live.write()  # rank 0's prefill, alive all along: its last chunk must not land now
    assert live.read()["finished"] == "FINISH_ABORT"
    _check(decodes, key, room, done)
