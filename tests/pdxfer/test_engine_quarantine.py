"""The quarantine rule (#11) through real engines: loopback and tcp with the fence forced off, nixl over cma, ucx-all.

A decode whose transport cannot fence must never report Failed while a byte
of the request may still land. Here the prefill's data transfer is held by
an event gate (`GatedConnection`: the write is posted only once the test
opens the gate) and the prefill is deaf to the decode's Abort until the test
lets it hear (`DeafPrefill`), so the decode's request times out while the
prefill is provably still writing. It must stay Quarantined — poll, outcome
and `quarantined()` say so, with the reason — and become Failed only after
the prefill's AbortAck: clean (the held bytes landed first, and nothing lands
after Failed) or cut (the prefill cut its transfer; nothing landed).

A killed prefill process releases a quarantine too: `test_a_killed_prefill_...`
freezes a real prefill process, lets the decode's request time out and its
control link go silent (ORPHANED: the frozen process still holds its data
connection), then SIGKILLs it.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from pdxfer_procs import Prefill, warm_up
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed, transport
from pdxfer.protocol import Abort

WAIT = 20.0
NO_FENCE = ["loopback", "tcp"]
# UCX "all" here (no NIC, no GPU): tcp, cma, posix/sysv, self; UCX_PROTO_INFO shows
# cma/memory carrying the puts. A tls list with commas does not reach UCX whole
# (NIXL's engine_config is itself comma-separated: only the first name counts).
NIXL_CMA = {"tls": "all"}


def _backend(param: str) -> tuple[str, dict]:
    """(backend, decode transport options) for a fixture parameter."""
    if param == "nixl-cma":
        if "nixl" not in transport.available():
            pytest.skip("nixl-cu12 is not installed here")
        return "nixl", NIXL_CMA
    if param == "ucx-all":  # a variant that cannot fence by itself (UCX's full list)
        if "ucx-all" not in transport.variants():
            pytest.skip("ucxx-cu12 is not installed here")
        return "ucx-all", {}
    return param, {"fence": False}


class GatedHandle:
    """A posted write held at the gate: in flight (poll False) until the gate opens, then real."""

    def __init__(self, conn: GatedConnection, args: tuple) -> None:
        self.conn, self.args, self.real = conn, args, None
        self.posted = threading.Event()

    def _post(self) -> None:
        if self.real is None and self.conn.gate.is_set():
            if self.conn.closed:
                raise self.conn.closed  # cut before the gate opened: failed, nothing posted
            self.real = self.conn.real.write(*self.args)
            self.posted.set()

    def poll(self) -> bool:
        if self.conn.closed and self.real is None:
            raise self.conn.closed
        self._post()
        return self.real is not None and self.real.poll()

    def wait(self, timeout: float | None = None) -> None:
        """Only close() drains this way; a held write never finishes before the gate opens."""
        from pdxfer.transport.errors import TransferTimeout

        if not self.conn.gate.wait(timeout):
            raise TransferTimeout(f"gated write still held after {timeout} s")
        self._post()
        if self.real is not None:
            self.real.wait(timeout)

    @property
    def nbytes(self) -> int:
        return int(self.args[2][:, 2].sum())


class GatedConnection:
    """Wraps a transport connection: writes that carry a notify wait for `gate`."""

    def __init__(self, real, gate: threading.Event, held: list) -> None:
        self.real, self.gate, self.held, self.closed = real, gate, held, None
        self.incarnation = real.incarnation  # the decode asks its transport about this link

    def write(self, local, remote, segments, notify=None, *, ready=None):
        assert ready is None  # host pools: the engine hands no producer event
        if notify is None:  # the warm-up writes: let them through
            return self.real.write(local, remote, segments, notify)
        handle = GatedHandle(self, (local, remote, segments, notify))
        self.held.append(handle)
        return handle

    def close(self) -> None:
        from pdxfer.transport.errors import ClosedError

        self.closed = ClosedError("gated connection closed (cut)")
        self.real.close()


class DeafPrefill:
    """A prefill that, once `arm()`ed, holds the decode's Aborts until `hear()`: its transfers keep
    flying meanwhile. Installed before the first control link, which binds `_on_message`."""

    def __init__(self, prefill: PrefillEngine, monkeypatch) -> None:
        self.prefill, self.held, self.got = prefill, None, threading.Event()
        self.real_on_message = prefill._on_message
        monkeypatch.setattr(prefill, "_on_message", self._on_message)

    def arm(self) -> None:
        self.held = []

    def _on_message(self, link, msg) -> None:
        if isinstance(msg, Abort) and self.held is not None:
            self.held.append((link, msg))
            self.got.set()
            return
        self.real_on_message(link, msg)

    def hear(self) -> None:
        held, self.held = self.held, None
        for link, msg in held:
            self.prefill._progress.call(self.real_on_message, link, msg)


class TickCounter:
    """Counts the decode's progress ticks: the event on which it asks `has_peer`."""

    def __init__(self, decode: DecodeEngine) -> None:
        self.count, self.cond, real = 0, threading.Condition(), decode._progress._tick

        def tick(now: float) -> float:
            try:
                return real(now)
            finally:
                with self.cond:
                    self.count += 1
                    self.cond.notify_all()

        decode._progress._tick = tick

    def wait_for(self, more: int) -> None:
        with self.cond:
            goal = self.count + more
            assert self.cond.wait_for(lambda: self.count >= goal, WAIT), "the decode stopped ticking"


@pytest.fixture
def gated(request, monkeypatch):
    backend, options = _backend(request.param)
    src = build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS)
    dst = build_pools(256, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    # The prefill waits long (its own deadline must not end the test's window);
    # the decode gives up on a request after 0.4 s and waits 0.3 s for the ack.
    theirs = NIXL_CMA if backend == "nixl" else {}
    prefill = PrefillEngine(src, config(backend, request_timeout=60.0, abort_grace=1.0,
                                        transport_options=theirs))
    decode = DecodeEngine(dst, config(backend, request_timeout=0.4, transport_options=options))
    assert decode._transport.capabilities.fence is False
    gate, held = threading.Event(), []
    real_connect = prefill._transport.connect
    monkeypatch.setattr(prefill._transport, "connect",
                        lambda addr: GatedConnection(real_connect(addr), gate, held))
    deaf = DeafPrefill(prefill, monkeypatch)
    try:
        _warm(prefill, decode, gate, held)
        deaf.arm()
        yield prefill, decode, src, dst, gate, held, deaf
    finally:
        gate.set()
        decode.close()
        prefill.close()


def _warm(prefill: PrefillEngine, decode: DecodeEngine, gate: threading.Event, held: list) -> None:
    """Bring the pair's links up with the gate open, so the test's request starts EXPECTED.

    The decode's short request wait also bounds its handshake (DIALING): on a
    loaded machine a first request may fail there; the link it started is
    cached, so a later one goes straight to Expect.
    """
    gate.set()
    for attempt in range(10):
        rid = f"warm{attempt}"
        decode.expect(rid, prefill.bootstrap_address, {"kv": [250]})
        prefill.send(rid, {"kv": [0]})
        try:
            if decode.wait(rid, WAIT) is KVPoll.Success:
                break
        except RequestFailed:
            continue
    else:
        raise AssertionError("no warm-up request succeeded in 10 tries")
    gate.clear()
    held.clear()


def _entries(pools: dict, kv: list[int]) -> torch.Tensor:
    return torch.stack([pools["kv"].view(f.name)[:, kv].clone().view(torch.uint8).flatten()
                        for f in pools["kv"].fields[:1]])


def _quarantined(decode: DecodeEngine, rid: str) -> None:
    until(lambda: decode.poll(rid) in (KVPoll.Quarantined, KVPoll.Failed), f"{rid} timed out")
    out = decode.outcome(rid)
    assert out.state is KVPoll.Quarantined, f"Failed while the prefill still writes: {out.reason}"
    assert "timed out" in out.reason and "quarantined until it does" in out.reason, out.reason
    assert decode.quarantined() == [rid]
    assert decode.failure(rid) is None  # not Failed: the entries are not the caller's


def _start_held(gated, rid: str, kv: list[int]) -> torch.Tensor:
    """Expect and send `rid` with its transfer held and its Abort unheard; the entries, untouched."""
    prefill, decode, _src, dst, _gate, held, deaf = gated
    decode.expect(rid, prefill.bootstrap_address, {"kv": kv})
    prefill.send(rid, {"kv": list(range(16))})
    until(lambda: held, "the prefill posted its transfer")
    assert deaf.got.wait(WAIT), "the decode never sent its Abort"
    _quarantined(decode, rid)
    return _entries(dst, kv)


@pytest.mark.parametrize("gated", [*NO_FENCE, "nixl-cma", "ucx-all"], indirect=True)
def test_a_timed_out_request_stays_quarantined_until_the_prefill_confirms(gated) -> None:
    prefill, decode, src, dst, gate, held, deaf = gated
    kv = list(range(40, 56))
    untouched = _start_held(gated, "q", kv)
    # The prefill's transfer goes through now, while the decode still holds the entries.
    gate.set()
    assert held[0].posted.wait(WAIT)
    held[0].real.wait(WAIT)
    landed = _entries(dst, kv)
    assert not torch.equal(untouched, landed), "the held transfer wrote nothing: the test proves nothing"
    assert torch.equal(landed, _entries(src, list(range(16))))
    assert decode.poll("q") is KVPoll.Quarantined
    deaf.hear()  # its transfers are done: the prefill's AbortAck(clean) ends the quarantine
    with pytest.raises(RequestFailed, match=r"timed out.*\(the prefill confirmed its transfers ended\)"):
        decode.wait("q", WAIT)
    assert decode.quarantined() == []
    # Failed means the entries are the caller's: reuse them; nothing of "q" lands after it.
    decode.release("q")
    for field in dst["kv"].fields:
        dst["kv"].view(field.name).view(torch.uint8)[:, kv] = 0xA5
    canary = _entries(dst, kv)
    decode.expect("next", prefill.bootstrap_address, {"kv": [200]})
    prefill.send("next", {"kv": [3]})
    assert decode.wait("next", WAIT) is KVPoll.Success
    assert torch.equal(_entries(dst, kv), canary)


@pytest.mark.parametrize("gated", [*NO_FENCE, "nixl-cma", "ucx-all"], indirect=True)
def test_a_cut_ack_ends_the_quarantine_and_the_cut_transfer_never_lands(gated) -> None:
    prefill, decode, src, dst, gate, held, deaf = gated
    kv = list(range(60, 76))
    untouched = _start_held(gated, "c", kv)
    deaf.hear()  # the transfer is still held: the prefill waits its grace, cuts, acks "cut"
    with pytest.raises(RequestFailed, match=r"\(the prefill cut its transfers and confirmed it\)"):
        decode.wait("c", WAIT)
    assert held[0].real is None and prefill.poll("c") is KVPoll.Failed
    gate.set()
    assert torch.equal(_entries(dst, kv), untouched)


@pytest.fixture
def orphan():
    """A decode (tcp, fence off) whose request "k" a frozen prefill process has orphaned."""
    dst = build_pools(256, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    cfg = config("tcp", timeout=1.0, request_timeout=0.4, transport_options={"fence": False})
    decode = DecodeEngine(dst, cfg)
    ticks = TickCounter(decode)
    prefill = Prefill("tcp", timeout=1.0)  # heartbeats keep its link alive until the freeze
    try:
        warm_up(decode, prefill, lambda attempt: 20 + attempt, 7, WAIT)  # up before the freeze
        decode.expect("k", prefill.address, {"kv": [10, 11], "state": [1]})
        prefill.freeze()  # alive, silent, holding its data connection: it may still write
        until(lambda: "data connections closed" in (decode.outcome("k").reason or "")
              or decode.poll("k") is KVPoll.Failed, "the silent link orphaned the request")
        out = decode.outcome("k")
        assert out.state is KVPoll.Quarantined, f"Failed while the prefill may write: {out.reason}"
        ticks.wait_for(3)  # the decode asked the transport at least twice since: still there
        assert decode.poll("k") is KVPoll.Quarantined and decode.quarantined() == ["k"]
        yield decode, prefill
    finally:
        prefill.kill(signal.SIGKILL)
        prefill.stop()
        decode.close()


def test_a_killed_prefill_releases_the_quarantine(orphan) -> None:
    decode, prefill = orphan
    prefill.kill(signal.SIGKILL)
    with pytest.raises(RequestFailed, match=r"released from quarantine: the prefill's connections are closed"):
        decode.wait("k", WAIT)
    assert decode.release("k").state is KVPoll.Failed


def test_a_resumed_prefill_that_lost_its_link_closes_its_data_connection_and_releases_the_orphan(orphan) -> None:
    decode, prefill = orphan
    prefill.kill(signal.SIGCONT)  # it finds its control link closed, cuts and never reopens
    with pytest.raises(RequestFailed, match=r"released from quarantine"):
        decode.wait("k", WAIT)
