"""The decode engine driven by directory records: refuse before dialing, incarnations, replaced peers.

In-process engines over a `LocalDirectory` (the etcd-backed runs of the same
paths, with real processes, are in tests/directory/test_etcd_faults.py): the
directory's logic is the same, and a LocalHub changes instantly, so these
cost milliseconds.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
from pdxfer_testkit import KV_FIELDS, build_pools, config, entries_crc, until
from test_tp_group import FIELDS, _global, _pools

from pdxfer import (
    DecodeEngine,
    HeteroTPDecode,
    HeteroTPPrefill,
    KVPoll,
    LayoutMismatchError,
    PeerLostError,
    PrefillEngine,
    layout,
)
from pdxfer.directory import LocalDirectory, PeerRecord, Slot, StaticDirectory, engine_record

WAIT = 10.0
SLOT = Slot("m", "prefill", "p0")


def _transfer(decode, prefill, rid: str, target, dst: list[int], src: list[int]) -> None:
    decode.expect(rid, target, {"kv": dst, "state": [0]})
    prefill.send(rid, {"kv": src, "state": [0]})
    assert decode.wait(rid, WAIT) is KVPoll.Success


@pytest.fixture
def hub_pair():
    """(a prefill-side directory, a decode-side directory) on one hub."""
    mine = LocalDirectory()
    theirs = LocalDirectory(mine.hub)
    yield mine, theirs
    theirs.close()
    mine.close()


def test_a_prefill_whose_layouts_differ_is_refused_before_it_is_dialed(hub_pair) -> None:
    prefill_dir, view = hub_pair
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    other = build_pools(16, 4, kv_fields=[layout.EntryField("k", 2, (2, 8), torch.float16)])
    descs = {n: layout.describe(a) for n, a in other.items()}
    fps = {n: layout.fingerprint(d) for n, d in descs.items()}
    record = PeerRecord(SLOT, addr, "tcp-somebody", "tcp", layouts=fps)
    prefill_dir.register(SLOT, record, {fps[n]: d for n, d in descs.items()})
    with DecodeEngine(build_pools(32, 8), config("tcp"), directory=view) as decode:
        with pytest.raises(LayoutMismatchError, match=r"pool 'kv'.*not dialed"):
            decode.expect("r1", view.resolve(SLOT), {"kv": [0], "state": [0]})
        renamed = PeerRecord(SLOT, addr, "tcp-somebody", "tcp", layouts={"kv": fps["kv"]})
        with pytest.raises(LayoutMismatchError, match=r"pool names differ: prefill only \[\], "
                                                       r"decode only \['state'\]"):
            decode.expect("r2", renamed, {"kv": [0], "state": [0]})
        assert decode.try_poll("r1") is None  # nothing was recorded
    with pytest.raises(BlockingIOError):
        listener.accept()  # and nothing was dialed
    listener.close()


def test_a_stale_record_is_re_resolved_when_the_directory_knows_better(hub_pair) -> None:
    prefill_dir, view = hub_pair
    src, dst = build_pools(64, 8, seed=1), build_pools(64, 8, seed=2)
    with PrefillEngine(src, config("tcp")) as prefill, \
            DecodeEngine(dst, config("tcp"), directory=view) as decode:
        fresh, layouts = engine_record(SLOT, prefill, src)
        stale = PeerRecord(SLOT, fresh.address, "tcp-gone", "tcp", layouts=fresh.layouts)
        # the directory has nothing newer: the Welcome from another engine is refused
        prefill_dir.register(SLOT, stale, layouts)
        decode.expect("r1", stale, {"kv": [1], "state": [0]})
        with pytest.raises(Exception, match="stale record"):
            decode.wait("r1", WAIT)
        assert isinstance(decode.failure_cause("r1"), PeerLostError)
        assert prefill.try_poll("r1") is None  # no Expect ever reached it
        # now the directory names the engine that answers there: re-resolved, served
        prefill_dir.register(SLOT, fresh, takeover=True)
        decode.expect("r2", stale, {"kv": [2, 3], "state": [1]})
        prefill.send("r2", {"kv": [5, 6], "state": [2]})
        assert decode.wait("r2", WAIT) is KVPoll.Success
        assert entries_crc(dst, "kv", [2, 3]) == entries_crc(src, "kv", [5, 6])


def test_a_replaced_prefill_is_cut_before_its_successor_is_dialed(hub_pair, backend) -> None:
    prefill_dir, view = hub_pair
    src = build_pools(64, 8, seed=1)
    dst = build_pools(64, 8, seed=2)
    # a long request wait: only the replacement can fail r1 within the test
    cfg = config(backend, request_timeout=60.0, timeout=30.0)
    with PrefillEngine(src, cfg) as old, PrefillEngine(src, cfg) as new, \
            DecodeEngine(dst, cfg, directory=view) as decode:
        record, layouts = engine_record(SLOT, old, src)
        prefill_dir.register(SLOT, record, layouts)
        _transfer(decode, old, "r0", view.resolve(SLOT), [0], [0])
        decode.expect("r1", view.resolve(SLOT), {"kv": [1], "state": [1]})
        until(lambda: old.try_poll("r1") is not None, "the Expect reaching the old prefill")
        at_dial = []
        dial = decode._dials.dial

        def spy(addr, expected):  # what r1 was when the successor got dialed
            at_dial.append((addr, decode.poll("r1")))
            return dial(addr, expected)

        decode._dials.dial = spy
        successor, _ = engine_record(SLOT, new, src)
        # Hold the decode's loop so the replacement and the next request queue up together:
        # the order inside one turn of the loop is what is checked, not a race.
        gate = threading.Event()
        decode._progress.call(gate.wait, WAIT)
        prefill_dir.register(SLOT, successor, takeover=True)  # "replaced" (another address)
        decode.expect("r2", view.resolve(SLOT), {"kv": [2], "state": [0]})
        gate.set()
        new.send("r2", {"kv": [2], "state": [0]})
        assert decode.wait("r2", WAIT) is KVPoll.Success
        assert at_dial == [(new.bootstrap_address, KVPoll.Failed)]
        assert isinstance(decode.failure_cause("r1"), PeerLostError)
        assert "was replaced by" in decode.failure_reason("r1")


def test_hetero_tp_groups_resolve_through_the_directory(hub_pair) -> None:
    prefill_dir, view = hub_pair
    values = _global(seed=21)
    src = [_pools(2, p, values) for p in range(2)]
    dst = _pools(1, 0, None)
    engines = [PrefillEngine(pools, config("tcp")) for pools in src]
    try:
        for p, (engine, pools) in enumerate(zip(engines, src, strict=True)):
            slot = Slot("m", "prefill", "p0", 0, p)
            record, layouts = engine_record(slot, engine, pools, tp_size=2)
            prefill_dir.register(slot, record, layouts)
        group = view.wait_group("m", "prefill", "p0", 0, timeout=WAIT)
        # TP 2 and TP 1 pools differ in fingerprint: the published descriptions decide
        assert group[0].layouts["kv"] != layout.fingerprint(layout.describe(dst["kv"]))
        with DecodeEngine(dst, config("tcp"), directory=view) as engine:
            decode = HeteroTPDecode(engine, dst)
            want = {"kv": np.array([3, 4]), "state": np.array([1])}
            decode.expect("r1", group, want)
            for e, pools in zip(engines, src, strict=True):
                HeteroTPPrefill(e, pools).send("r1", {"kv": np.array([7, 8]), "state":
                                                      np.array([2])}, decode_tp=1)
            assert decode.wait("r1", WAIT) is KVPoll.Success
            for f in FIELDS["kv"]:
                assert torch.equal(dst["kv"].view(f.name)[:, [3, 4]], values["kv"][f.name][:, [7, 8]])
            # a group whose pools cannot match is refused before any sub-request exists
            bad = [PeerRecord(r.slot, r.address, r.engine, "tcp", 2, 1, {"kv": r.layouts["kv"]})
                   for r in group]
            with pytest.raises(LayoutMismatchError, match="pool names differ"):
                decode.expect("r2", bad, want)
            assert engine.try_poll("r2#tp0>0") is None and engine.try_poll("r2#tp1>0") is None
    finally:
        for e in engines:
            e.close()


def test_a_static_record_checks_nothing_like_a_plain_address() -> None:
    src, dst = build_pools(64, 8, seed=1, kv_fields=KV_FIELDS), build_pools(64, 8, seed=2)
    with PrefillEngine(src, config("tcp")) as prefill, DecodeEngine(dst, config("tcp")) as decode:
        static = StaticDirectory.from_groups("m", {"p0": prefill.bootstrap_address})
        record = static.resolve(SLOT)
        assert record.engine is None and record.layouts == {}
        _transfer(decode, prefill, "r1", record, [4], [9])
        assert entries_crc(dst, "kv", [4]) == entries_crc(src, "kv", [9])
        static.close()
