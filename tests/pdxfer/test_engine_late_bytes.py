"""No byte lands after Failed over a transport that cannot fence, with real bytes in flight (#25 item 1).

A decode whose transport cannot fence frees a failed request's entries on
the prefill's word that its transfers ended (AbortAck, or its own Abort).
That word follows the close of the data link the prefill cut — and a close
is not a fence on the receiver: bytes already in the socket buffers (tcp),
or a write the sender's NIC still runs (verbs `fence="qp"`), land after it.
So the decode must also see its transport report every link the word names
settled (`TransportEngine.settled`).

Each test here moves a large layer-major request from shuffled pages (one
4 KiB segment per field, layer and page), keeps real bytes in flight at the
abort, then samples the destination the moment the decode reports Failed
and again once every link the prefill had has ended: nothing may change in
between. What keeps bytes in flight is the receiver made slow, never a held
write:

* tcp: the decode's stream threads are held at their landing step (the
  `guard` each takes before reading a payload) while the prefill's writers
  fill the socket buffers — the test waits until the kernel holds at least
  64 KiB for them (`FIONREAD`). They are let go once the decode has handled
  the prefill's word: on the code before the fix the request is Failed by
  then and the buffered bytes land after it.
* verbs-sim `fence="qp"`: the software NIC is held inside the first packet
  of the request (its `on_packet` hook, before the copy), let go once the
  decode has recorded Failed — or once the prefill posts on the link's QP
  after moving it to ERR (the fix: it flushes behind a marker WR and says
  `Bye(quiet)` only once that completed, which needs the NIC; a drain that
  did not wait for it, or a decode that did not wait for the word's links,
  reaches Failed with the packet still held).
* loopback, nixl-all (cma), ucx-all: nothing is held. Bytes are moving when
  the abort comes (the test waits until some landed; the last chunk is never
  sent, so the request cannot succeed first). On these the prefill's close
  already waits out what it moved (loopback's copy under the arrival's
  guard, NIXL's post under the agent lock with cma writing synchronously,
  ucx's receiver retiring its worker on `Bye`), so the old code passes too:
  they pin that the new proof — `Bye(quiet)` after a drain — ends the
  quarantine rather than leaving it waiting.

The cross-process test does it with no abort call: the prefill process is
stopped (SIGSTOP) longer than the decode's request wait plus grace, then
continued; it hears the decode's Abort, cuts after its grace and acks.
"""

from __future__ import annotations

import fcntl
import signal
import struct
import termios
import threading

import numpy as np
import pytest
import torch
from pdxfer_procs import Prefill, warm_up
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestFailed, layout, transport
from pdxfer.protocol import Abort, AbortAck

WAIT = 20.0
ENTRIES = 256  # 32 KiB per entry: an 8 MiB pool
MOVED = 192  # pages the request moves: 6 MiB in 1536 segments of 4 KiB
QUEUED = 64 << 10  # bytes the kernel must hold for the held tcp streams before the abort
CONFIGS = ["tcp", "loopback", "nixl-all", "verbs-sim-qp", "ucx-all"]


def _transport(param: str) -> tuple[str, dict]:
    """(EngineConfig.transport, transport_options) of a configuration that cannot fence."""
    if param in ("tcp", "loopback"):
        return param, {"fence": False}
    if param == "verbs-sim-qp":
        return "verbs-sim", {"fence": "qp"}
    if param not in transport.variants():
        pytest.skip(f"{param} is not installed here")
    return param, {}


def _pages(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(ENTRIES)[:MOVED], rng.permutation(ENTRIES)[:MOVED]


def _buffer(pools: dict) -> torch.Tensor:
    return layout.arena_buffers(pools["kv"])[0]


class WordSeen:
    """Sets `event` once the decode has handled the prefill's Abort/AbortAck for `rid`.

    Installed before the first control link, which binds `_on_message`.
    """

    def __init__(self, decode: DecodeEngine, monkeypatch, rid: str) -> None:
        self.event, self.state = threading.Event(), None
        real = decode._on_message

        def on_message(link, msg) -> None:
            real(link, msg)
            if isinstance(msg, (Abort, AbortAck)) and msg.request == rid and not self.event.is_set():
                self.state = decode.poll(rid)  # what the caller sees the moment the word was handled
                self.event.set()

        monkeypatch.setattr(decode, "_on_message", on_message)


class AtFailed:
    """The destination buffer copied the moment the decode records `rid` Failed (in its table)."""

    def __init__(self, decode: DecodeEngine, monkeypatch, rid: str, buf: torch.Tensor) -> None:
        self.copy: torch.Tensor | None = None
        real = decode._table.finish

        def finish(req, ok, reason=None, error=None) -> bool:
            done = real(req, ok, reason, error)
            if done and req.id == rid and not ok:
                self.copy = buf.clone()  # under the table lock: what a caller polling now sees
            return done

        monkeypatch.setattr(decode._table, "finish", finish)


def _queued(sock) -> int:
    buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    return struct.unpack("i", buf)[0]


class StreamHold:
    """tcp: the decode's stream threads from the prefill held at their landing step (`guard`)."""

    def __init__(self, decode: DecodeEngine, sender: str) -> None:
        self.streams = [link for link in decode._transport.inbound.links() if link.sender == sender]
        assert self.streams, "the warm-up left no data stream from the prefill"
        for stream in self.streams:
            stream.guard.acquire()
        self.held = True

    @staticmethod
    def released_by(word: WordSeen, failed: AtFailed) -> bool:
        """Once the decode handled the word: a correct decode cannot be Failed while we hold."""
        return word.event.is_set()

    def in_flight(self) -> None:
        until(lambda: sum(_queued(s.sock) for s in self.streams) >= QUEUED,
              f"{QUEUED} B of the request waiting in the decode's socket buffers")

    def release(self) -> None:
        if self.held:
            self.held = False
            for stream in self.streams:
                stream.guard.release()


class PacketHold:
    """verbs-sim: the NIC held inside the first packet the prefill's link sends once armed.

    `flushing` is set when the prefill posts on one of the link's QPs after it
    went to ERR: a sender draining its link waits for the NIC to flush behind
    that WR, which it cannot while the packet is held (the fix does that).
    """

    def __init__(self, qpns: list[int], monkeypatch) -> None:
        from pdxfer.transport.verbs import sim
        from pdxfer.transport.verbs.sim import nic

        self.fabric, self.qpns = sim.fabric(), set(qpns)
        self.entered, self.go, self.flushing = threading.Event(), threading.Event(), threading.Event()
        self.fabric.on_packet = self._hook
        real = self.fabric.post_send

        def post_send(qp, wqes):
            if qp.qpn in self.qpns and qp.state == nic.ERR:
                self.flushing.set()
            return real(qp, wqes)

        monkeypatch.setattr(self.fabric, "post_send", post_send)

    def _hook(self, qpn: int, key: int) -> None:
        if qpn in self.qpns and not self.entered.is_set():
            self.entered.set()
            self.go.wait(WAIT)

    def in_flight(self) -> None:
        assert self.entered.wait(WAIT), "the request's first packet never reached the NIC"

    def released_by(self, word: WordSeen, failed: AtFailed) -> bool:
        """Once the decode recorded Failed (it must not have yet), or the prefill flushes its link."""
        return failed.copy is not None or self.flushing.is_set()

    def release(self) -> None:
        self.fabric.on_packet = None
        self.go.set()

    def quiet(self) -> bool:
        with self.fabric.lock:
            return not any(self.fabric.inflight.values())


@pytest.fixture
def late(request, monkeypatch):
    """A warmed prefill/decode pair that cannot fence, the word hook on the decode; closed after."""
    backend, options = _transport(request.param)
    src = build_pools(ENTRIES, 4, kind="layer", seed=1, kv_fields=BIG_KV_FIELDS)
    dst = build_pools(ENTRIES, 4, kind="layer", seed=2, kv_fields=BIG_KV_FIELDS)
    # The prefill cuts a few ms after a request fails; the decode waits 50 ms for its ack.
    prefill = PrefillEngine(src, config(backend, timeout=5.0, request_timeout=60.0, abort_grace=0.005,
                                        transport_options=options))
    decode = DecodeEngine(dst, config(backend, timeout=5.0, request_timeout=60.0, abort_grace=0.05,
                                      transport_options=options))
    assert decode._transport.capabilities.fence is False
    word = WordSeen(decode, monkeypatch, "big")
    try:
        decode.expect("warm", prefill.bootstrap_address, {"kv": [ENTRIES - 1]})
        prefill.send("warm", {"kv": [0]})
        assert decode.wait("warm", WAIT) is KVPoll.Success
        yield request.param, prefill, decode, dst, word
    finally:
        decode.close()
        prefill.close()


def _run(late, monkeypatch, side: str) -> None:
    param, prefill, decode, dst, word = late
    src_idx, dst_idx = _pages(7)
    engine = prefill._transport.engine_id
    link = prefill._transport.outbound.live(decode._transport.engine_id)
    assert link is not None, "the warm-up left no data link"
    hold = None
    if param == "tcp":
        hold = StreamHold(decode, engine)
    elif param == "verbs-sim-qp":
        hold = PacketHold(link.qpns, monkeypatch)
    failed = AtFailed(decode, monkeypatch, "big", _buffer(dst))
    before = _buffer(dst).clone()
    old_links = {id(lk) for lk in decode._transport.inbound.links() if lk.sender == engine}
    try:
        decode.expect("big", prefill.bootstrap_address, {"kv": dst_idx})
        # All but the last page, not marked last: the request cannot succeed before the abort.
        prefill.send("big", {"kv": src_idx[:-1]}, last=False)
        if hold is not None:
            hold.in_flight()
        else:
            until(lambda: not torch.equal(_buffer(dst), before), "some of the request landed")
        (decode if side == "decode" else prefill).abort("big", "the test aborts mid-transfer")
        if hold is not None:
            until(lambda: hold.released_by(word, failed), "the moment to let the held bytes go")
            hold.release()
        with pytest.raises(RequestFailed, match="aborted"):
            decode.wait("big", WAIT)
        at_failed = failed.copy
        assert at_failed is not None
        if link.dead:  # the prefill cut its link: "later" is once everything it had here ended
            until(lambda: not any(id(lk) in old_links for lk in decode._transport.inbound.links()),
                  "every data link the prefill had when it cut has ended here")
        # (not cut: every transfer completed, and an ack follows the last byte landed)
        if isinstance(hold, PacketHold):
            until(hold.quiet, "no packet in flight on the fabric")
        later = _buffer(dst)
        changed = int((later != at_failed).sum())
        assert changed == 0, f"{changed} bytes of the destination changed after the decode reported Failed"
        if hold is not None and word.event.is_set():  # its bytes were held: they were in flight
            assert word.state is not KVPoll.Failed, "Failed on the prefill's word alone"
        # The test proves something only if bytes of the request were moving at the abort.
        assert not torch.equal(at_failed, before), "no byte of the request ever landed"
        # Nothing outside the request's entries was touched (a scratch arena reads `before`).
        outside = np.setdiff1d(np.arange(ENTRIES), dst_idx)
        old = layout.LayerMajorArena(BIG_KV_FIELDS, ENTRIES, "cpu", buf=torch.empty_like(before))
        layout.arena_buffers(old)[0].copy_(before)  # after building: building may fill
        for field in BIG_KV_FIELDS:
            got, want = (a.view(field.name).view(torch.uint8)[:, outside] for a in (dst["kv"], old))
            assert torch.equal(got, want), f"field {field.name!r} changed outside the request's entries"
        assert decode.quarantined() == []
        assert decode.release("big").state is KVPoll.Failed
    finally:
        if hold is not None:
            hold.release()


@pytest.mark.parametrize("late", CONFIGS, indirect=True)
def test_decode_abort_with_bytes_in_flight_lands_nothing_after_failed(late, monkeypatch) -> None:
    _run(late, monkeypatch, "decode")


@pytest.mark.parametrize("late", CONFIGS, indirect=True)
def test_prefill_abort_with_bytes_in_flight_lands_nothing_after_failed(late, monkeypatch) -> None:
    _run(late, monkeypatch, "prefill")


def test_a_prefill_stopped_past_the_request_wait_lands_nothing_after_failed(monkeypatch) -> None:
    """tcp across processes, no abort call: the prefill is frozen (SIGSTOP) with bytes in flight
    until the decode gave up on the request and its grace passed, then continued (SIGCONT)."""
    dst = build_pools(ENTRIES, 4, kind="layer", seed=2, kv_fields=BIG_KV_FIELDS)
    # Liveness (5 s) well past the freeze; the request wait (1.5 s) and grace end inside it.
    decode = DecodeEngine(dst, config("tcp", timeout=5.0, request_timeout=1.5, abort_grace=0.05,
                                      transport_options={"fence": False}))
    word = WordSeen(decode, monkeypatch, "big")
    failed = AtFailed(decode, monkeypatch, "big", _buffer(dst))
    prefill = Prefill("tcp", 0, 5.0, "--kind", "layer", "--entries", str(ENTRIES), "--grace", "0.005",
                      "--fence", "off")
    hold = None
    try:
        warm_up(decode, prefill, lambda attempt: ENTRIES - 1, 0, WAIT)
        senders = {lk.sender for lk in decode._transport.inbound.links()}
        assert len(senders) == 1, senders
        engine = senders.pop()
        hold = StreamHold(decode, engine)
        old_links = {id(lk) for lk in hold.streams}
        src_idx, dst_idx = _pages(11)
        before = _buffer(dst).clone()
        decode.expect("big", prefill.address, {"kv": dst_idx})
        prefill.send("big", src_idx.tolist(), [])
        hold.in_flight()
        prefill.freeze()
        until(lambda: decode.poll("big") is KVPoll.Quarantined,
              "the decode gave up on the request and waited out its grace for an ack")
        assert not word.event.is_set()
        prefill.kill(signal.SIGCONT)  # it hears the Abort, cuts after its grace, and acks
        assert word.event.wait(WAIT), "the continued prefill never answered the decode's Abort"
        hold.release()
        with pytest.raises(RequestFailed, match="timed out"):
            decode.wait("big", WAIT)
        at_failed = failed.copy
        assert at_failed is not None
        until(lambda: not any(id(lk) in old_links for lk in decode._transport.inbound.links()),
              "every data stream the prefill had when it cut has ended here")
        changed = int((_buffer(dst) != at_failed).sum())
        assert changed == 0, f"{changed} bytes of the destination changed after the decode reported Failed"
        assert word.state is not KVPoll.Failed, "Failed on the prefill's word alone"
        assert not torch.equal(at_failed, before), "no byte of the request ever landed"
    finally:
        if hold is not None:
            hold.release()
        prefill.stop()
        decode.close()
