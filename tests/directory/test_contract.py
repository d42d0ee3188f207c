"""The directory contract, once, over every implementation: local, static and a real etcd.

Each test builds "processes" (directories) on one store: a `LocalHub`, the
static table's hub, or one etcd cluster id. An etcd view changes
asynchronously, so every check of another process's view waits on the view's
own change (`wait_for`), never on a sleep.
"""

from __future__ import annotations

import threading

import pytest

from pdxfer.directory import (
    DirectoryError,
    EtcdDirectory,
    LocalDirectory,
    PeerRecord,
    Slot,
    SlotTakenError,
    StaticDirectory,
)

WAIT = 10.0  # a safety net far above any expected delay; events end the waits
M = "m"


def rec(slot: Slot, engine: str = "e1", address: str = "127.0.0.1:1000", *, tp_size: int = 1,
        dp_size: int = 1, layouts: dict | None = None) -> PeerRecord:
    return PeerRecord(slot, address, engine, "tcp", tp_size, dp_size, layouts or {}, 2, {"pid": 1})


def ps(instance: str, tp: int = 0, dp: int = 0) -> Slot:
    return Slot(M, "prefill", instance, dp, tp)


class World:
    """Processes on one store of one implementation; closed at the end."""

    def __init__(self, kind: str, etcd_url: str | None, cluster: str) -> None:
        self.kind, self.url, self.cluster = kind, etcd_url, cluster
        self.made: list = []
        self._static: StaticDirectory | None = None

    def process(self, follow=((M, "prefill"),)):
        if self.kind == "etcd":
            d = EtcdDirectory(self.url, cluster=self.cluster, ttl=5, follow=follow)
            assert d.wait_connected(WAIT), d.health()
        elif self.kind == "static":
            if self._static is None:
                d = self._static = StaticDirectory()
            else:
                d = LocalDirectory(self._static.hub)
        else:
            d = LocalDirectory(self.made[0].hub if self.made else None)
        self.made.append(d)
        return d

    def close(self) -> None:
        for d in reversed(self.made):
            d.close()


@pytest.fixture(params=["local", "static", "etcd"])
def world(request, cluster):
    url = request.getfixturevalue("etcd_url") if request.param == "etcd" else None
    w = World(request.param, url, cluster)
    yield w
    w.close()


def events(directory) -> list:
    seen: list = []
    directory.subscribe(seen.append)
    return seen


def test_register_resolve_unregister(world) -> None:
    a, b = world.process(), world.process()
    seen = events(b)
    r = rec(ps("p0"))
    a.register(r.slot, r)
    assert b.wait_for(lambda: b.resolve(r.slot) == r, WAIT)
    assert b.peers(M, "prefill") == {r.slot: r}
    a.unregister(r.slot)
    assert b.wait_for(lambda: len(seen) == 2, WAIT)
    assert b.resolve(r.slot) is None
    assert [(e.kind, e.slot) for e in seen] == [("up", r.slot), ("down", r.slot)]
    assert seen[1].old == r and seen[1].record is None
    assert b.health().connected


def test_groups_are_complete_or_none_and_instances_list_complete_ones(world) -> None:
    a, b = world.process(), world.process()
    r0 = rec(ps("p0", tp=0), "e0", "127.0.0.1:1000", tp_size=2)
    r1 = rec(ps("p0", tp=1), "e1", "127.0.0.1:1001", tp_size=2)
    single = rec(ps("p1"), "e2", "127.0.0.1:1002")
    a.register(r0.slot, r0)
    a.register(single.slot, single)
    assert b.wait_for(lambda: b.resolve(single.slot) is not None and b.resolve(r0.slot), WAIT)
    assert b.group(M, "prefill", "p0") is None  # rank 1 missing
    assert b.instances(M, "prefill") == ["p1"]
    with pytest.raises(DirectoryError, match=r"incomplete after 0.05 s: ranks \[0\] registered"):
        b.wait_group(M, "prefill", "p0", 0, timeout=0.05)
    a.register(r1.slot, r1)
    assert b.wait_group(M, "prefill", "p0", 0, timeout=WAIT) == [r0, r1]
    assert b.instances(M, "prefill") == ["p0", "p1"]


def test_a_new_engine_in_a_slot_is_replaced_or_refused(world) -> None:
    a, b, c = world.process(), world.process(), world.process()
    seen = events(c)
    old = rec(ps("p0"), "e-old", "127.0.0.1:1000")
    a.register(old.slot, old)
    assert c.wait_for(lambda: c.resolve(old.slot) == old, WAIT)
    elsewhere = rec(ps("p0"), "e-other", "127.0.0.1:2000")
    with pytest.raises(SlotTakenError, match="held by engine e-old at 127.0.0.1:1000"):
        b.register(elsewhere.slot, elsewhere)
    same_port = rec(ps("p0"), "e-new", "127.0.0.1:1000")  # a restart in place
    b.register(same_port.slot, same_port)
    assert c.wait_for(lambda: c.resolve(old.slot) == same_port, WAIT)
    forced = rec(ps("p0"), "e-forced", "127.0.0.1:3000")
    a.register(forced.slot, forced, takeover=True)
    assert c.wait_for(lambda: len(seen) == 3, WAIT)
    assert c.resolve(old.slot) == forced
    kinds = [(e.kind, e.old.engine if e.old else None, e.record.engine) for e in seen]
    assert kinds == [("up", None, "e-old"), ("replaced", "e-old", "e-new"),
                     ("replaced", "e-new", "e-forced")]


def test_layouts_are_published_once_and_read_by_fingerprint(world) -> None:
    from pdxfer_testkit import build_pools

    from pdxfer import PrefillEngine, layout
    from pdxfer.directory import engine_record

    a, b = world.process(), world.process()
    pools = build_pools(16, 4)
    with PrefillEngine(pools) as engine:
        record, layouts = engine_record(ps("p0"), engine, pools, meta={"rpc": "x"})
        assert record.layouts == {n: layout.fingerprint(layout.describe(p)) for n, p in pools.items()}
        a.register(record.slot, record, layouts)
        fp = record.layouts["kv"]
        assert b.wait_for(lambda: b.layout(fp) is not None, WAIT)
        assert layout.fingerprint(b.layout(fp)) == fp
        # a second publisher of the same format changes nothing
        again = rec(ps("p1"), "e9", layouts=record.layouts)
        a.register(again.slot, again, layouts)
        assert b.wait_for(lambda: b.resolve(again.slot) is not None, WAIT)
        assert layout.fingerprint(b.layout(fp)) == fp


def test_list_then_watch_misses_nothing_and_repeats_nothing(world) -> None:
    a = world.process()
    before = [rec(ps(f"a{i}"), f"e{i}") for i in range(10)]
    for r in before:
        a.register(r.slot, r)
    racing = [rec(ps(f"b{i}"), f"f{i}") for i in range(30)]
    writer = threading.Thread(target=lambda: [a.register(r.slot, r) for r in racing])
    writer.start()
    b = world.process()  # lists and starts watching while the writer registers
    seen = events(b)
    writer.join()
    want = {r.slot: r for r in before + racing}
    assert b.wait_for(lambda: b.peers(M, "prefill") == want, WAIT)
    # each slot announced once: by the listing or by the watch, never both
    ups = [e.slot for e in seen if e.kind == "up"]
    assert len(ups) == len(set(ups))
    assert not [e for e in seen if e.kind != "up"]


def test_close_withdraws_a_process_records(world) -> None:
    a, b = world.process(), world.process()
    r = rec(ps("p0"))
    a.register(r.slot, r)
    assert b.wait_for(lambda: b.resolve(r.slot) is not None, WAIT)
    a.close()
    a.close()  # idempotent
    # etcd: the lease is revoked (TTL 5 s here): peers see it at once, not after the TTL
    assert b.wait_for(lambda: b.resolve(r.slot) is None, 2.0)
    with pytest.raises(DirectoryError, match="is closed"):
        a.register(r.slot, r)


def test_a_failing_subscriber_does_not_stop_the_others(world) -> None:
    a, b = world.process(), world.process()

    def broken(event) -> None:
        raise RuntimeError("subscriber bug")

    b.subscribe(broken)
    seen = events(b)
    stop = b.subscribe(lambda e: seen.append(("second", e.kind)))
    r = rec(ps("p0"))
    a.register(r.slot, r)
    assert b.wait_for(lambda: len(seen) == 2, WAIT)
    stop()
    a.unregister(r.slot)
    assert b.wait_for(lambda: len(seen) == 3, WAIT)
    assert seen[2].kind == "down"


def test_bad_input_is_refused_before_anything_is_written(world) -> None:
    a = world.process()
    with pytest.raises(DirectoryError, match="Slot.model must be a non-empty name"):
        Slot("a/b", "prefill", "p0")
    with pytest.raises(DirectoryError, match="Slot.role must be one of"):
        Slot(M, "router", "p0")
    with pytest.raises(DirectoryError, match="must be a PeerRecord for that slot"):
        a.register(ps("p0"), rec(ps("p1")))
    with pytest.raises(DirectoryError, match="rank outside the record's sizes|outside"):
        a.register(ps("p0", tp=2), rec(ps("p0", tp=2), tp_size=2))
    assert a.resolve(ps("p0")) is None and a.resolve(ps("p1")) is None
