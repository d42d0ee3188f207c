"""The directory on a real etcd under faults: killed, frozen and restarted prefills; etcd down; compaction.

Leases are 1 s where a test must see one expire (the suite's etcd runs with
tuned raft timers, so etcd grants 1 s), and every wait ends on the event it
waits for — a change of a directory's view — with a safety net far above it.
"""

from __future__ import annotations

import signal
import time

import pytest
from dir_procs import DirPrefill
from netproxy import NetProxy
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, entries_crc, until

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine
from pdxfer.directory import EtcdDirectory, Slot, engine_record
from pdxfer.directory.etcd_client import EtcdClient

WAIT = 15.0
SLOT = Slot("m", "prefill", "p0")
FOLLOW = [("m", "prefill")]


def follower(url: str, cluster: str, **kw) -> EtcdDirectory:
    d = EtcdDirectory(url, cluster=cluster, ttl=kw.pop("ttl", 5), follow=FOLLOW, **kw)
    assert d.wait_connected(WAIT), d.health()
    return d


def kinds(seen: list) -> list[tuple[str, str | None]]:
    return [(e.kind, (e.record or e.old).engine) for e in seen]


def transfer(decode: DecodeEngine, prefill: DirPrefill, rid: str, record, pages: range) -> None:
    """One request through `record`, its bytes checked against the prefill's seeded pools."""
    decode.expect(rid, record, {"kv": list(pages), "state": [0]})
    prefill.send(rid, list(range(len(pages))), [0])
    assert decode.wait(rid, WAIT) is KVPoll.Success
    src = build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS)
    assert entries_crc(decode_pools(decode), "kv", list(pages)) == entries_crc(
        src, "kv", list(range(len(pages))))


def decode_pools(decode: DecodeEngine) -> dict:
    return decode._pools.arenas  # the test's own pools, read back for the byte check


@pytest.fixture
def decode_and_view(etcd_url, cluster):
    view = follower(etcd_url, cluster)
    decode = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), config("tcp"),
                          directory=view)
    yield decode, view
    decode.close()
    view.close()


def _registered(view: EtcdDirectory, url: str, cluster: str, ttl: float) -> tuple[DirPrefill, list]:
    """A prefill process on a `ttl` lease, once `view` saw it up; and the view's events."""
    seen: list = []
    view.subscribe(seen.append)
    prefill = DirPrefill(url, cluster, ttl=ttl)
    if not view.wait_for(lambda: len(seen) == 1, WAIT):
        prefill.stop()
        raise AssertionError(f"the prefill never showed up: {seen}")
    return prefill, seen


def _down_after(view: EtcdDirectory, seen: list, act) -> float:
    """Seconds from `act()` to the view's next event (the "down" it causes)."""
    start, count = time.monotonic(), len(seen)
    act()
    assert view.wait_for(lambda: len(seen) > count, WAIT)
    assert seen[count].kind == "down", seen
    return time.monotonic() - start


def test_a_sigkilled_prefill_is_down_within_ttl_plus_one_second(etcd_url, cluster, decode_and_view):
    decode, view = decode_and_view
    prefill, seen = _registered(view, etcd_url, cluster, ttl=1)
    try:
        record = view.resolve(SLOT)
        assert record.engine == prefill.engine and record.address == prefill.address
        transfer(decode, prefill, "r1", record, range(8))
        took = _down_after(view, seen, prefill.kill)
        assert took < 1 + 1.0, f"down {took:.2f} s after SIGKILL with a 1 s lease"
        assert kinds(seen) == [("up", prefill.engine), ("down", prefill.engine)]
        assert view.resolve(SLOT) is None
        assert decode.poll("r1") is KVPoll.Success  # the directory changed no finished request
    finally:
        prefill.stop()


def test_a_frozen_prefill_goes_down_and_comes_back_up_as_itself(etcd_url, cluster, decode_and_view):
    _, view = decode_and_view
    prefill, seen = _registered(view, etcd_url, cluster, ttl=1)
    try:
        took = _down_after(view, seen, prefill.freeze)
        assert took < 1 + 1.0, f"down {took:.2f} s after SIGSTOP with a 1 s lease"
        prefill.kill(signal.SIGCONT)
        assert view.wait_for(lambda: len(seen) == 3, WAIT)
        # the same process re-registers on a new lease: "up" again, never "replaced"
        assert kinds(seen) == [("up", prefill.engine), ("down", prefill.engine),
                               ("up", prefill.engine)]
    finally:
        prefill.stop()


def test_kill_and_restart_in_the_same_slot_reaches_the_new_incarnation(etcd_url, cluster,
                                                                          decode_and_view):
    decode, view = decode_and_view
    seen: list = []
    view.subscribe(seen.append)
    # TTL 30: the restart registers before the old lease expires, so it is a "replaced" (a
    # spawn outlasting the TTL would be down + up), however slow a loaded machine starts it
    first = DirPrefill(etcd_url, cluster, ttl=30)
    second = None
    try:
        assert view.wait_for(lambda: view.resolve(SLOT) is not None, WAIT)
        transfer(decode, first, "r1", view.resolve(SLOT), range(8))
        first.kill()
        second = DirPrefill(etcd_url, cluster, ttl=30, port=first.port)  # same slot, same port
        assert view.wait_for(lambda: len(seen) == 2, WAIT)
        assert kinds(seen) == [("up", first.engine), ("replaced", second.engine)]
        assert seen[1].old.engine == first.engine
        transfer(decode, second, "r2", view.resolve(SLOT), range(8, 16))
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_etcd_killed_mid_run_degrades_health_never_a_transfer(own_etcd, cluster):
    pools = build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS)
    prefill = PrefillEngine(pools, config("tcp"))
    registrant = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=1)
    view = follower(own_etcd.url, cluster, ttl=1)
    # the request below stays in flight across the outage: give it room under load
    decode = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS),
                          config("tcp", request_timeout=WAIT), directory=view)
    try:
        record, layouts = engine_record(SLOT, prefill, pools)
        registrant.register(SLOT, record, layouts)
        assert view.wait_for(lambda: view.resolve(SLOT) == record, WAIT)
        decode.expect("r1", record, {"kv": list(range(8)), "state": [0]})
        until(lambda: prefill.try_poll("r1") is not None, "the Expect reaching the prefill")
        own_etcd.kill()
        assert view.wait_for(lambda: view.health().degraded, WAIT)
        assert registrant.wait_for(lambda: registrant.health().degraded, WAIT)
        assert "lease" in registrant.health().reason
        prefill.send("r1", {"kv": list(range(8)), "state": [0]})  # in flight while etcd is down
        assert decode.wait("r1", WAIT) is KVPoll.Success
        assert view.resolve(SLOT) == record  # the view freezes; it is not emptied
        decode.expect("r2", view.resolve(SLOT), {"kv": list(range(8, 16)), "state": [1]})
        prefill.send("r2", {"kv": list(range(8)), "state": [0]})
        assert decode.wait("r2", WAIT) is KVPoll.Success
        own_etcd.start()  # same data, same ports
        assert view.wait_connected(WAIT) and registrant.wait_connected(WAIT)
        assert view.wait_for(lambda: view.resolve(SLOT) == record, WAIT)
        again = Slot("m", "prefill", "p1")
        registrant.register(again, engine_record(again, prefill, pools)[0])
        assert view.wait_for(lambda: view.resolve(again) is not None, WAIT)
    finally:
        decode.close()
        view.close()
        registrant.close()
        prefill.close()


def _partitioned_view(etcd_url: str, cluster: str):
    proxy = NetProxy(int(etcd_url.rsplit(":", 1)[1]))
    view = EtcdDirectory(proxy.url, cluster=cluster, ttl=5, follow=FOLLOW)
    assert view.wait_connected(WAIT)
    return proxy, view


def test_compaction_while_cut_off_forces_a_relist_that_finds_lost_deletions(etcd_url, cluster):
    writer = EtcdDirectory(etcd_url, cluster=cluster, ttl=5)
    proxy, view = _partitioned_view(etcd_url, cluster)
    client = EtcdClient(etcd_url)
    try:
        keep, gone = Slot("m", "prefill", "keep"), Slot("m", "prefill", "gone")
        for slot, engine in ((keep, "e1"), (gone, "e2")):
            writer.register(slot, _record(slot, engine))
        assert view.wait_for(lambda: view.resolve(gone) is not None and view.resolve(keep), WAIT)
        assert view.relists == 1
        seen: list = []
        view.subscribe(seen.append)
        proxy.cut()
        assert view.wait_for(lambda: view.health().degraded, WAIT)
        writer.unregister(gone)  # the DELETE the view misses ...
        revision = client.put("/elsewhere", b"x")
        client.compact(revision)  # ... and that history is gone too
        proxy.restore()
        assert view.wait_for(lambda: len(seen) == 1, WAIT)
        assert view.relists == 2
        assert [(e.kind, e.slot) for e in seen] == [("down", gone)]
        assert view.resolve(keep) is not None
        assert view.wait_connected(WAIT)
    finally:
        view.close()
        proxy.close()
        writer.close()
        client.close()


def test_a_broken_stream_resumes_from_its_revision_without_a_relist(etcd_url, cluster):
    writer = EtcdDirectory(etcd_url, cluster=cluster, ttl=5)
    proxy, view = _partitioned_view(etcd_url, cluster)
    try:
        a, b = Slot("m", "prefill", "a"), Slot("m", "prefill", "b")
        writer.register(a, _record(a, "e1"))
        assert view.wait_for(lambda: view.resolve(a) is not None, WAIT)
        proxy.cut()
        assert view.wait_for(lambda: view.health().degraded, WAIT)
        writer.unregister(a)
        writer.register(b, _record(b, "e2"))
        proxy.restore()
        assert view.wait_for(lambda: view.resolve(a) is None and view.resolve(b) is not None, WAIT)
        assert view.relists == 1  # the missed changes came from etcd's history
    finally:
        view.close()
        proxy.close()
        writer.close()


def _record(slot: Slot, engine: str):
    from pdxfer.directory import PeerRecord

    return PeerRecord(slot, "127.0.0.1:1000", engine, "tcp")


def test_engine_config_timeout_is_independent_of_the_lease() -> None:
    # the directory's TTL and the engine's liveness timeout are separate knobs
    assert EngineConfig(timeout=2.0).timeout == 2.0
