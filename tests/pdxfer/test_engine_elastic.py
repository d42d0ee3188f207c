"""Elastic pools through real engines: the page/state boundary moves while requests flow.

Both sides serve `{"kv": pools.page, "state": pools.state}` of a
`layout.ElasticPools`; every test runs over loopback, tcp and verbs-sim
(`transport.create` by name, nothing else of the transport). Byte checks
compare the decode's whole allocation with a prediction built from a
snapshot: only the destination entries may change, to the source entries'
bytes, and a refused resize or transfer changes nothing at all.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from pdxfer_testkit import KV_FIELDS, STATE_FIELDS, config, until

from pdxfer import (
    DecodeEngine,
    KVPoll,
    LayoutError,
    PrefillEngine,
    RequestFailed,
    ResizeBlockedError,
    layout,
    transport,
)
from pdxfer.protocol import Abort, Expect, pack_indices

BACKENDS = [b for b in ("loopback", "tcp", "verbs-sim") if b in transport.available()]
NO_FENCE = {"loopback": {"fence": False}, "tcp": {"fence": False}, "verbs-sim": {"fence": "qp"}}
WAIT = 20.0


def _pools(slots: int, boundary: int, seed: int) -> layout.ElasticPools:
    pools = layout.ElasticPools(KV_FIELDS, STATE_FIELDS, slots, boundary)
    gen = torch.Generator().manual_seed(seed)
    pools.buf.copy_(torch.randint(0, 256, pools.buf.shape, dtype=torch.uint8, generator=gen))
    return pools


def _served(pools: layout.ElasticPools) -> dict:
    return {"kv": pools.page, "state": pools.state}


@pytest.fixture(params=BACKENDS)
def elastic(request):
    """A prefill (32 slots, 24 pages) and a decode (48 slots, 36 pages), seeded; closed after."""
    src, dst = _pools(32, 24, 1), _pools(48, 36, 2)
    prefill = PrefillEngine(_served(src), config(request.param))
    decode = DecodeEngine(_served(dst), config(request.param))
    try:
        yield prefill, decode, src, dst
    finally:
        decode.close()
        prefill.close()


def _entry(pools: layout.ElasticPools, pool: str, i: int) -> torch.Tensor:
    """Entry `i`'s bytes in every plane, concatenated (a copy)."""
    return torch.cat([plane[i * w: i * w + n] for plane, w, n in
                      zip(pools.planes, pools.plane_bytes, pools.entry_bytes(pool), strict=True)])


def _predict(dst: layout.ElasticPools, before: torch.Tensor, src: layout.ElasticPools,
             moves: list[tuple[str, list[int], list[int]]]) -> torch.Tensor:
    """`before` with each destination entry replaced by its source entry, by hand."""
    want = before.clone()
    base = dst.planes[0].storage_offset() - dst.buf.storage_offset()
    (w,), (n_page,), (n_state,) = dst.plane_bytes, dst.entry_bytes("page"), dst.entry_bytes("state")
    for pool, s_idx, d_idx in moves:
        n = n_page if pool == "page" else n_state
        for s, d in zip(s_idx, d_idx, strict=True):
            want[base + d * w: base + d * w + n] = _entry(src, pool, s)
    return want


def _roundtrip(prefill, decode, rid: str, kv: tuple[list[int], list[int]],
               state: tuple[list[int], list[int]]) -> None:
    decode.expect(rid, prefill.bootstrap_address, {"kv": kv[1], "state": state[1]})
    prefill.send(rid, {"kv": kv[0], "state": state[0]})
    assert decode.wait(rid, WAIT) is KVPoll.Success
    assert prefill.wait(rid, WAIT) is KVPoll.Success
    decode.release(rid)
    prefill.release(rid)


def test_a_resize_is_refused_while_a_named_request_is_in_flight(elastic) -> None:
    prefill, decode, src, dst = elastic
    decode.expect("r1", prefill.bootstrap_address, {"kv": [34, 35], "state": [40]})
    before = dst.buf.clone()
    # The state pool would take pages 30..35: r1 expects bytes in 34 and 35.
    with pytest.raises(ResizeBlockedError, match=r"decode's boundary 36 -> 30 refused: request\(s\) 'r1' "
                       r"still hold pool 'kv' entries it would move or retire \(slots 30..35") as err:
        decode.resize(dst, 30, used=[34, 35])
    assert err.value.request_ids == ["r1"]
    assert torch.equal(dst.buf, before) and dst.boundary == 36
    # A move that touches none of r1's entries runs while r1 is in flight (its handshake
    # may still be running: the Hello then carries the old range, the LiveRange the new).
    report = decode.resize(dst, 37, used=[])
    assert report.entries == 0 and dst.boundary == 37 and not decode.poll("r1").finished
    # The prefill side: a sent request's sources block its own resize the same way
    # (queued here: no decode expects "p1" yet).
    prefill.send("p1", {"kv": [20, 21], "state": [28]})
    with pytest.raises(ResizeBlockedError, match=r"prefill's boundary 24 -> 20 refused.*'p1'") as err:
        prefill.resize(src, 20, used=[20, 21])
    assert err.value.request_ids == ["p1"]
    prefill.send("r1", {"kv": [5, 6], "state": [29]})
    decode.expect("p1", prefill.bootstrap_address, {"kv": [10, 11], "state": [42]})
    for rid in ("r1", "p1"):
        assert decode.wait(rid, WAIT) is KVPoll.Success and prefill.wait(rid, WAIT) is KVPoll.Success
    # Finished: the same moves go through now, and what landed moves with its entries.
    landed = [_entry(dst, "page", i) for i in (34, 35)]
    report = decode.resize(dst, 30, used=[34, 35])
    assert report.moved.old.tolist() == [34, 35] and report.moved.new.tolist() == [0, 1]
    assert all(torch.equal(_entry(dst, "page", i), w) for i, w in zip((0, 1), landed, strict=True))
    assert report.nbytes == 2 * dst.entry_bytes("page")[0]
    assert prefill.resize(src, 20, used=[20, 21]).moved.new.tolist() == [0, 1]


def test_a_resize_waits_for_the_requests_in_its_way_with_a_bound(elastic) -> None:
    prefill, decode, src, dst = elastic
    decode.expect("slow", prefill.bootstrap_address, {"kv": [35], "state": [44]})
    with pytest.raises(ResizeBlockedError, match=r"refused after waiting 0\.2 s: request\(s\) 'slow'"):
        decode.resize(dst, 34, used=[35], wait=0.2)
    assert dst.boundary == 36
    prefill.send("slow", {"kv": [3], "state": [30]})
    report = decode.resize(dst, 34, used=[35], wait=WAIT)  # returns once "slow" finished
    assert decode.poll("slow") is KVPoll.Success
    assert report.moved.old.tolist() == [35]
    assert torch.equal(_entry(dst, "page", int(report.moved.new[0])), _entry(src, "page", 3))


def test_a_resize_then_a_transfer_into_a_newly_live_entry(elastic) -> None:
    prefill, decode, src, dst = elastic
    _roundtrip(prefill, decode, "warm", ([1], [1]), ([30], [40]))  # links up, old ranges known
    # The decode's state pool grows into pages 32..35, its page pool then into states 36..37;
    # the prefill's state pool grows too, so a newly live entry is also a source.
    decode.resize(dst, 32, used=[])
    prefill.resize(src, 22, used=[])
    before = dst.buf.clone()
    _roundtrip(prefill, decode, "grown", ([2, 3], [4, 5]), ([22], [33]))
    assert torch.equal(dst.buf, _predict(dst, before, src, [("page", [2, 3], [4, 5]),
                                                             ("state", [22], [33])]))
    grown = _entry(dst, "state", 33)
    report = decode.resize(dst, 38, used=[33])  # state 33 holds "grown": it moves to the top
    assert report.moved.new.tolist() == [47] and torch.equal(_entry(dst, "state", 47), grown)
    before = dst.buf.clone()
    _roundtrip(prefill, decode, "pages", ([0, 1], [36, 37]), ([23], [39]))
    assert torch.equal(dst.buf, _predict(dst, before, src, [("page", [0, 1], [36, 37]),
                                                             ("state", [23], [39])]))


def test_a_transfer_into_an_entry_no_longer_live_is_refused_on_both_sides(elastic) -> None:
    prefill, decode, src, dst = elastic
    _roundtrip(prefill, decode, "warm", ([1], [1]), ([30], [40]))
    decode.resize(dst, 40, used=[])  # states 36..39 become pages
    decode.resize(dst, 38, used=[])  # and 38..39 states again: 36 and 37 stay pages
    # The decode refuses to name them...
    with pytest.raises(LayoutError, match=r"destination index 37 at position 0 is outside the live entries 38..47"):
        decode.expect("dead", prefill.bootstrap_address, {"kv": [2], "state": [37]})
    with pytest.raises(LayoutError, match=r"destination index 38 at position 1 is >= the 38 entries"):
        decode.expect("dead", prefill.bootstrap_address, {"kv": [2, 38], "state": [40]})
    # ... and the prefill refuses its own retired sources, and a decode that names one anyway.
    prefill.resize(src, 26, used=[])
    with pytest.raises(LayoutError, match=r"source index 25 at position 0 is outside the live entries 26..31"):
        prefill.send("dead", {"kv": [2], "state": [25]})
    assert prefill.try_poll("dead") is None  # refused: nothing recorded, nothing to abort (#25)
    before = dst.buf.clone()
    session = next(iter(decode._sessions.values()))  # a decode that skips its own check
    decode._progress.call(session.link.send, Expect("ghost", 999, {"kv": pack_indices(np.array([2])),
                                                                   "state": pack_indices(np.array([37]))}))
    until(lambda: prefill.try_poll("ghost") is not None, "the prefill heard the Expect")
    with pytest.raises(LayoutError, match=r"pool 'state' destination index 37 at position 0 is outside "
                       r"the decode's live entries 38..47 \(as it last announced them\)"):
        prefill.send("ghost", {"kv": [3], "state": [27]})
    prefill.abort("ghost")
    with pytest.raises(RequestFailed):
        prefill.wait("ghost", WAIT)
    assert torch.equal(dst.buf, before)
    # The link still serves: the next request lands.
    _roundtrip(prefill, decode, "after", ([4], [2]), ([27], [39]))


def test_an_expect_checked_before_a_racing_resize_is_checked_again(elastic, monkeypatch) -> None:
    prefill, decode, _src, dst = elastic
    import pdxfer.decode as decode_module

    real = decode_module.expect_message
    calls = []

    def racing(*args):
        out = real(*args)
        if not calls:  # checked against the old ranges; a resize retires state 36 right after
            decode.resize(dst, 37, used=[])
        calls.append(args)
        return out

    monkeypatch.setattr(decode_module, "expect_message", racing)
    with pytest.raises(LayoutError, match=r"destination index 36 at position 0 is outside the live entries 37..47"):
        decode.expect("raced", prefill.bootstrap_address, {"kv": [1], "state": [36]})
    assert len(calls) == 1 and dst.boundary == 37 and decode.try_poll("raced") is None


class _DeafPrefill:
    """Holds the decode's Aborts until `hear()`: the request then stays Aborting, or Quarantined."""

    def __init__(self, prefill: PrefillEngine, monkeypatch) -> None:
        self.prefill, self.held, self.got = prefill, [], threading.Event()
        self.real = prefill._on_message
        monkeypatch.setattr(prefill, "_on_message", self._on_message)

    def _on_message(self, link, msg) -> None:
        if isinstance(msg, Abort):
            self.held.append((link, msg))
            self.got.set()
            return
        self.real(link, msg)

    def hear(self) -> None:
        for link, msg in self.held:
            self.prefill._progress.call(self.real, link, msg)


@pytest.mark.parametrize("fence", [True, False], ids=["fence", "quarantine"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resize_during_an_abort_or_a_quarantine_waits_for_failed(backend, fence, monkeypatch) -> None:
    src, dst = _pools(32, 24, 1), _pools(48, 36, 2)
    prefill = PrefillEngine(_served(src), config(backend))
    options = {} if fence else NO_FENCE[backend]
    # A long grace with a fence, so the abort is still unanswered while we resize;
    # a short one without, so the request reaches Quarantined soon.
    decode = DecodeEngine(_served(dst), config(backend, abort_grace=30.0 if fence else 0.2,
                                               transport_options=options))
    try:
        assert decode._transport.capabilities.fence is fence
        deaf = _DeafPrefill(prefill, monkeypatch)
        _roundtrip(prefill, decode, "warm", ([1], [1]), ([30], [40]))
        decode.expect("gone", prefill.bootstrap_address, {"kv": [35], "state": [41]})
        until(lambda: prefill.try_poll("gone") is not None, "the prefill heard the Expect")
        decode.abort("gone", "scheduler gave up")
        assert deaf.got.wait(WAIT)
        if not fence:
            until(lambda: decode.poll("gone") is KVPoll.Quarantined, "the request is quarantined")
            assert decode.quarantined() == ["gone"]
        assert decode.poll("gone") in (KVPoll.WaitingForInput, KVPoll.Quarantined)
        before = dst.buf.clone()
        for target, used in ((33, [35]), (42, [41])):  # its page, then its state
            with pytest.raises(ResizeBlockedError, match=r"'gone'"):
                decode.resize(dst, target, used=used)
        assert torch.equal(dst.buf, before) and dst.boundary == 36
        deaf.hear()  # the prefill acks: the request is Failed, nothing of it lands any more
        report = decode.resize(dst, 33, used=[35], wait=WAIT)
        assert decode.poll("gone") is KVPoll.Failed
        assert report.moved.old.tolist() == [35]
        _roundtrip(prefill, decode, "next", ([2], [5]), ([31], [41]))
    finally:
        decode.close()
        prefill.close()
