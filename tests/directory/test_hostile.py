"""Hostile and broken stores: bad records written straight into a real etcd, a frozen and a rebuilt etcd.

Each hostile value is put under the followed prefix with the project's etcd
client (raw bytes where the key is not UTF-8), as anyone who can reach etcd
could. A follower must skip it (counted in `health().skipped`, logged once
per key) and keep showing every good record, on both of its paths: the
first listing and the watch. A frozen etcd (SIGSTOP) must show as degraded
within the probe bound, and an etcd rebuilt from nothing at the same URL
must be noticed and re-listed within the same bound (docs/directory.md,
"When etcd is down"). Waits end on a change of the view, never on a sleep.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, RequestFailed
from pdxfer.directory import (
    DirectoryError,
    EtcdDirectory,
    LocalDirectory,
    PeerRecord,
    RecordError,
    Slot,
)
from pdxfer.directory.etcd import root
from pdxfer.directory.etcd_client import EtcdClient

WAIT = 15.0  # a safety net; every wait ends on the event it waits for
FOLLOW = [("m", "prefill")]
# Scheduling slack over a documented bound: threads on two busy cores wake late.
SLACK = 1.0


def rec(slot: Slot, engine: str, **kw) -> PeerRecord:
    return PeerRecord(slot, "127.0.0.1:1000", engine, "tcp", kw.pop("tp_size", 1), 1, {}, 2, {})


def good_value(**changes) -> bytes:
    d = json.loads(rec(Slot("m", "prefill", "x"), "e-bad").encode())
    d.update(changes)
    return json.dumps(d, separators=(",", ":")).encode()


PEERS = "m/prefill/peers/"
# (what, key below the cluster's root (bytes where not UTF-8), value)
HOSTILE = [
    ("non-ASCII digit rank", PEERS + "bad/\u00b2/0", good_value()),
    ("non-UTF-8 key bytes", PEERS.encode() + b"\xff\xfe/0/0", good_value()),
    ("a 5,000-digit rank", PEERS + "bad/0/" + "9" * 5000, good_value()),
    ("a value nested 5,000 deep", PEERS + "bad/0/0", b"[" * 5000 + b"]" * 5000),
    ("a value that is not UTF-8", PEERS + "bad/0/0", b'{"format": 1, "address": "\xff"}'),
    ("tp_size 2**40", PEERS + "bad/0/0", good_value(tp_size=2**40)),
    ("tp_size 10**7", PEERS + "bad/0/0", good_value(tp_size=10**7)),
    ("dp_size 2**40", PEERS + "bad/0/0", good_value(dp_size=2**40)),
    ("protocol true", PEERS + "bad/0/0", good_value(protocol=True)),
    ("NaN in meta", PEERS + "bad/0/0", good_value().replace(b'"meta":{}', b'"meta":{"x":NaN}')),
    ("port 99999", PEERS + "bad/0/0", good_value(address="127.0.0.1:99999")),
    ("a layout nested 5,000 deep", "m/prefill/layouts/" + "f" * 64, b"{\"a\":" * 5000 + b"1" + b"}" * 5000),
    ("a layout with a 30-digit int", "m/prefill/layouts/" + "f" * 64, b'{"version": 1' + b"0" * 30 + b"}"),
]


def raw_key(cluster: str, key: str | bytes) -> bytes:
    return root(cluster).encode() + (key if isinstance(key, bytes) else key.encode())


def follower(url: str, cluster: str, **kw) -> EtcdDirectory:
    d = EtcdDirectory(url, cluster=cluster, ttl=kw.pop("ttl", 5), follow=FOLLOW, **kw)
    assert d.wait_connected(WAIT), d.health()
    return d


@pytest.mark.parametrize("what, key, value", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_value_is_skipped_and_counted_and_blinds_no_follower(etcd_url, cluster, what,
                                                                       key, value) -> None:
    client = EtcdClient(etcd_url)
    writer = EtcdDirectory(etcd_url, cluster=cluster, ttl=5)
    watching = follower(etcd_url, cluster)  # meets the value on its watch
    listing = None
    try:
        before, after = Slot("m", "prefill", "before"), Slot("m", "prefill", "after")
        writer.register(before, rec(before, "e1"))
        client.put(raw_key(cluster, key), value)  # type: ignore[arg-type]  (bytes keys: raw)
        writer.register(after, rec(after, "e2"))
        assert watching.wait_for(lambda: watching.resolve(after) is not None, WAIT), watching.health()
        listing = follower(etcd_url, cluster)  # meets it in its first listing
        for view in (watching, listing):
            assert view.resolve(before) is not None and view.resolve(after) is not None
            assert view.wait_for(lambda v=view: v.health().skipped >= 1, WAIT), what
            health = view.health()
            assert health.connected, health
            assert view.instances("m", "prefill") == ["after", "before"]
        # the watch goes on after the bad value
        later = Slot("m", "prefill", "later")
        writer.register(later, rec(later, "e3"))
        for view in (watching, listing):
            assert view.wait_for(lambda v=view: v.resolve(later) is not None, WAIT), view.health()
            assert view.health().connected
    finally:
        for d in (listing, watching, writer):
            if d is not None:
                d.close()
        client.close()


def test_a_bad_value_is_logged_once_per_key_and_counted_each_time(etcd_url, cluster, caplog) -> None:
    client = EtcdClient(etcd_url)
    view = follower(etcd_url, cluster)
    try:
        caplog.set_level(logging.WARNING, logger="pdxfer.directory")
        bad = raw_key(cluster, PEERS + "bad/0/0")
        for n in range(3):
            client.put(bad, good_value(tp_size=2**40 + n))  # type: ignore[arg-type]
        assert view.wait_for(lambda: view.health().skipped == 3, WAIT), view.health()
        lines = [r for r in caplog.records if "skipping the value" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "tp_size must be an int in 1..4096, got 1099511627776" in lines[0].getMessage()
        assert view.health().connected
    finally:
        view.close()
        client.close()


def test_a_slot_whose_value_turns_unreadable_goes_down(etcd_url, cluster) -> None:
    client = EtcdClient(etcd_url)
    writer = EtcdDirectory(etcd_url, cluster=cluster, ttl=5)
    view = follower(etcd_url, cluster)
    seen: list = []
    view.subscribe(seen.append)
    try:
        slot = Slot("m", "prefill", "p0")
        writer.register(slot, rec(slot, "e1"))
        assert view.wait_for(lambda: len(seen) == 1, WAIT)
        client.put(raw_key(cluster, slot.path()), b"[" * 5000)  # type: ignore[arg-type]
        assert view.wait_for(lambda: len(seen) == 2, WAIT)
        assert [(e.kind, e.slot) for e in seen] == [("up", slot), ("down", slot)]
        assert view.resolve(slot) is None and view.health().connected
    finally:
        view.close()
        writer.close()
        client.close()


def test_huge_sizes_never_reach_group_instances_or_wait_group(etcd_url, cluster) -> None:
    client = EtcdClient(etcd_url)
    view = follower(etcd_url, cluster)
    try:
        for tp in (0, 1):
            client.put(raw_key(cluster, PEERS + f"p0/0/{tp}"),  # type: ignore[arg-type]
                       good_value(tp_size=2**40))
        assert view.wait_for(lambda: view.health().skipped == 2, WAIT)
        start = time.monotonic()
        assert view.group("m", "prefill", "p0") is None
        assert view.instances("m", "prefill") == []
        with pytest.raises(DirectoryError, match=r"incomplete after 0.01 s: ranks \[\] registered"):
            view.wait_group("m", "prefill", "p0", timeout=0.01)
        assert time.monotonic() - start < 1.0
    finally:
        view.close()
        client.close()


@pytest.mark.parametrize("kw, match", [
    ({"tp_size": 2**40}, r"tp_size must be an int in 1..4096, got 1099511627776"),
    ({"tp_size": 4097}, r"tp_size must be an int in 1..4096, got 4097"),
    ({"dp_size": 0}, r"dp_size must be an int in 1..4096, got 0"),
    ({"protocol": 2**16}, r"protocol must be null or an int in 0..65535, got 65536"),
    ({"protocol": True}, r"protocol must be null or an int in 0..65535, got True"),
    ({"address": "h:0"}, r"address must be 'host:port' with a port 1..65535, got 'h:0'"),
    ({"address": "h:\u00b2"}, r"address must be 'host:port' with a port 1..65535"),
    ({"engine": "e" * 257}, r"engine must be a string of 1..256 characters"),
    ({"layouts": {f"p{i}": "f" for i in range(257)}}, r"layouts must be an object of at most 256"),
])
def test_every_number_and_string_a_record_carries_is_bounded(kw, match) -> None:
    slot = Slot("m", "prefill", "p0")
    with pytest.raises(RecordError, match=f"record for m/prefill/peers/p0/0/0 is malformed: {match}"):
        PeerRecord.decode(slot, good_value(**kw))
    fields = {"tp_size": 1, "dp_size": 1, "address": "127.0.0.1:1000", "engine": "e",
              "protocol": 2, "layouts": {}, **kw}
    record = PeerRecord(slot, fields["address"], fields["engine"], "tcp", fields["tp_size"],
                        fields["dp_size"], fields["layouts"], fields["protocol"], {})
    writer = LocalDirectory()
    try:  # what a peer would refuse is refused at registration, before anything is written
        with pytest.raises(DirectoryError, match=match):
            writer.register(slot, record)
    finally:
        writer.close()


def test_keys_and_values_past_the_bounds_are_refused_by_name() -> None:
    with pytest.raises(RecordError, match="ranks in ASCII digits"):
        Slot.from_path("m/prefill/peers/p0/\u00b2/0")
    with pytest.raises(RecordError, match="ranks in ASCII digits"):
        Slot.from_path("m/prefill/peers/p0/0/" + "9" * 5000)
    with pytest.raises(RecordError, match=r"Slot.dp must be an int in 0..4095, got 4096"):
        Slot.from_path("m/prefill/peers/p0/4096/0")
    with pytest.raises(DirectoryError, match=r"Slot.tp must be an int in 0..4095, got 4096"):
        Slot("m", "prefill", "p0", 0, 4096)
    slot = Slot("m", "prefill", "p0")
    with pytest.raises(RecordError, match="nests 5000 levels deep, over the 32 limit"):
        PeerRecord.decode(slot, b"[" * 5000 + b"]" * 5000)
    with pytest.raises(RecordError, match="not UTF-8"):
        PeerRecord.decode(slot, b"\xff")
    with pytest.raises(RecordError, match="NaN is not a JSON number"):
        PeerRecord.decode(slot, good_value().replace(b'"meta":{}', b'"meta":{"x":NaN}'))
    # brackets inside strings are not nesting
    deep_text = good_value().replace(b'"meta":{}', b'"meta":{"x":"' + b"[" * 100 + b'"}')
    assert PeerRecord.decode(slot, deep_text).meta == {"x": "[" * 100}


# -- a frozen etcd, a rebuilt etcd ------------------------------------------------------------

def test_a_frozen_etcd_shows_degraded_within_probe_plus_timeout(own_etcd, cluster) -> None:
    view = follower(own_etcd.url, cluster, ttl=3)  # probe 1 s, each call bounded by 1 s
    writer = None
    bound = view.probe + view._client.timeout
    try:
        own_etcd.kill(signal.SIGSTOP)
        start = time.monotonic()
        assert view.wait_for(lambda: view.health().degraded, WAIT), view.health()
        took = time.monotonic() - start
        assert took < bound + SLACK, f"degraded {took:.2f} s after SIGSTOP; bound {bound:.2f} s"
        assert "probe" in view.health().reason
        own_etcd.kill(signal.SIGCONT)
        assert view.wait_connected(WAIT), view.health()
        writer = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=3)
        slot = Slot("m", "prefill", "p0")
        writer.register(slot, rec(slot, "e1"))
        assert view.wait_for(lambda: view.resolve(slot) is not None, WAIT), view.health()
    finally:
        own_etcd.kill(signal.SIGCONT)
        view.close()
        if writer is not None:
            writer.close()


@pytest.mark.parametrize("overtake", [False, True], ids=["behind", "overtaken"])
def test_an_etcd_rebuilt_from_nothing_at_the_same_url_is_relisted(own_etcd, cluster,
                                                                  overtake) -> None:
    """behind: the fresh store's revision is below the view's (a resumed watch would wait for
    it in silence); overtaken: it passed the view's before anyone looked, so only the epoch
    key tells the stores apart (a resumed watch would keep a record the new store lacks)."""
    old_writer = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=3)
    gone_writer = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=3)
    view = follower(own_etcd.url, cluster, ttl=3)
    client = EtcdClient(own_etcd.url)
    new_writer = None
    bound = view.probe + view._client.timeout
    try:
        kept, stale, new = (Slot("m", "prefill", n) for n in ("kept", "stale", "new"))
        old_writer.register(kept, rec(kept, "e-kept"))
        gone_writer.register(stale, rec(stale, "e-stale"))
        for n in range(20):  # the old store's revision well above a fresh one's
            client.put(f"/elsewhere/{n}", b"x")
        assert view.wait_for(lambda: view.resolve(kept) and view.resolve(stale), WAIT)
        old_revision = view.health().revision
        gone_writer.close(revoke=False)  # its process went down with the old store
        own_etcd.kill()
        shutil.rmtree(Path(own_etcd.data_dir) / "data")  # from nothing: same URL, empty store
        own_etcd.start()
        start = time.monotonic()
        if overtake:
            for n in range(old_revision + 5):
                client.put(f"/elsewhere/{n}", b"y")
        new_writer = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=3)
        new_writer.register(new, rec(new, "e-new"))
        assert view.wait_for(lambda: view.resolve(new) is not None and view.resolve(stale) is None,
                             WAIT), (view.health(), view.peers("m", "prefill"))
        took = time.monotonic() - start
        assert took < bound + SLACK, f"saw the rebuilt store after {took:.2f} s; bound {bound:.2f} s"
        assert view.rebuilds >= 1 and view.relists >= 2
        # the live registrant's lease is unknown to the new store: it re-grants and re-puts
        assert view.wait_for(lambda: view.resolve(kept) is not None, WAIT)
        assert view.resolve(kept).engine == "e-kept"
        assert view.wait_connected(WAIT), view.health()
    finally:
        view.close()
        old_writer.close()
        gone_writer.close()
        if new_writer is not None:
            new_writer.close()
        client.close()



def test_a_record_whose_address_never_answers_fails_naming_that_address() -> None:
    # a listener whose kernel completes TCP handshakes (its backlog) and that never reads or
    # writes: the request fails by its own timeout, and the reason says which prefill stalled
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with DecodeEngine(build_pools(64, 16), config("tcp", timeout=1.0)) as decode:
            decode.expect("r1", PeerRecord.at(address), {"kv": [1]})
            with pytest.raises(RequestFailed, match=rf"timed out: no progress for 1.0 s while "
                                                    rf"Bootstrapping \(prefill at {address}\)"):
                decode.wait("r1", WAIT)


def test_a_burst_of_huge_values_met_while_catching_up_is_relisted_not_resumed(own_etcd,
                                                                              cluster) -> None:
    # A watch resuming after a break gets up to 1,000 revisions in one message: twelve 1.4 MiB
    # values make one of ~22 MiB, over MAX_MESSAGE, and resuming would meet it again forever.
    from netproxy import NetProxy

    proxy = NetProxy(own_etcd.client_port)
    view = follower(proxy.url, cluster)
    client = EtcdClient(own_etcd.url)
    writer = EtcdDirectory(own_etcd.url, cluster=cluster, ttl=5)
    try:
        proxy.cut()
        assert view.wait_for(lambda: view.health().degraded, WAIT)
        for i in range(12):
            client.put(raw_key(cluster, PEERS + f"huge{i}/0/0"), b"x" * (1400 << 10))  # type: ignore[arg-type]
        good = Slot("m", "prefill", "good")
        writer.register(good, rec(good, "e1"))
        proxy.restore()
        assert view.wait_for(lambda: view.resolve(good) is not None, WAIT), view.health()
        assert view.wait_for(lambda: view.health().skipped == 12, WAIT), view.health()
        assert view.wait_connected(WAIT), view.health()
    finally:
        view.close()
        writer.close()
        client.close()
        proxy.close()
