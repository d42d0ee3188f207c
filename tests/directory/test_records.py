"""Records and keys: what is stored, read back strictly; the package's public names, pinned."""

from __future__ import annotations

import json

import pytest

import pdxfer.directory as directory
from pdxfer.directory import DirectoryError, PeerRecord, RecordError, Slot, open_directory
from pdxfer.directory.etcd_client import parse_endpoints, prefix_end

SLOT = Slot("m", "prefill", "p0", 1, 2)


def test_public_names_are_pinned() -> None:
    assert directory.__all__ == [
        "EVENTS", "DirectoryError", "DirectoryEvent", "DirectoryHealth", "DirectoryUnavailable",
        "EtcdDirectory", "LocalDirectory", "LocalHub", "PeerDirectory", "PeerRecord", "RecordError",
        "Slot", "SlotTakenError", "StaticDirectory", "claim", "engine_record", "open_directory",
    ]


def test_a_record_round_trips_and_its_key_names_its_slot() -> None:
    record = PeerRecord(SLOT, "10.0.0.1:7001", "tcp-abc", "tcp", 4, 2, {"kv": "f" * 64}, 2,
                        {"rpc": "10.0.0.1:7000"})
    assert PeerRecord.decode(SLOT, record.encode()) == record
    assert SLOT.path() == "m/prefill/peers/p0/1/2"
    assert Slot.from_path(SLOT.path()) == SLOT


@pytest.mark.parametrize("value, match", [
    (b"{", "is not JSON"),
    (json.dumps({"format": 99}).encode(), "has format 99, this pdxfer reads 1"),
    (json.dumps({"format": 1, "address": 5}).encode(), "is malformed"),
    (b" " * (64 << 10 | 1), "over the 65536 B limit"),
])
def test_a_value_that_is_not_a_record_is_refused_with_the_key(value, match) -> None:
    with pytest.raises(RecordError, match=f"record for m/prefill/peers/p0/1/2 .*{match}|{match}"):
        PeerRecord.decode(SLOT, value)


def test_a_rank_outside_its_own_sizes_is_refused() -> None:
    value = PeerRecord(Slot("m", "prefill", "p0"), "h:1", "e", "tcp", 2, 2).encode()
    with pytest.raises(RecordError, match=r"rank \(dp 1, tp 2\) outside its own sizes"):
        PeerRecord.decode(SLOT, value)


def test_bad_keys_endpoints_and_urls_are_refused() -> None:
    with pytest.raises(RecordError, match="is not <model>/<role>/peers"):
        Slot.from_path("m/prefill/other/p0/0/0")
    with pytest.raises(DirectoryError, match="TLS and auth are not supported"):
        parse_endpoints("https://h:2379")
    assert parse_endpoints("h1:1,http://h2:2") == [("h1", 1), ("h2", 2)]
    with pytest.raises(DirectoryError, match=r"etcd://host:port\[,host:port\]/<cluster> or local:"):
        open_directory("redis://h:1")
    with pytest.raises(DirectoryError, match="cluster must be a non-empty name"):
        open_directory("etcd://127.0.0.1:1/a b")
    assert prefix_end("/pdx/c/") == b"/pdx/c0"
    with pytest.raises(DirectoryError, match="only a record with a slot and an engine id"):
        PeerRecord.at("h:1").encode()
