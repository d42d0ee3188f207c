"""Kit cases: writes land exactly, bad input is refused before a byte moves, notify follows the data.

What they pin is the contract in docs/architecture.md: bytes land exactly
where the table says and nowhere else; bad input is refused before a byte
moves and leaves the connection usable; notify follows the data; many
concurrent and many small transfers work; registration refuses what it
cannot address.
"""

from __future__ import annotations

import gc
import weakref

import msgpack
import numpy as np
import pytest
import torch

from .. import Capabilities
from ..errors import BoundsError, CapabilityError, ProtocolError, RegistrationError
from .rig import (
    DST_BYTES,
    SRC_BYTES,
    WAIT,
    Backend,
    Rig,
    RigPool,
    assert_untouched_then_usable,
    good_table,
    need,
    with_row,
)
from .tables import CANARY, assert_landed, random_table


def test_capabilities_are_declared_and_honoured(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    caps = rig.tx.capabilities
    assert isinstance(caps, Capabilities) and caps.notify
    assert caps == rig.rx.capabilities
    if not caps.read:
        with pytest.raises(CapabilityError, match="does not support read"):
            rig.conn.read(rig.src_region, rig.remote, good_table())
    assert ("port" in rig.rx.address()) == caps.listens


@pytest.mark.parametrize("rows,max_row", [(1, 3 << 20), (7, 300_000), (300, 9000), (2000, 700)])
def test_random_tables_round_trip_with_checksums_and_canaries(backend: Backend, kit_rigs: RigPool, rows: int,
                                                               max_row: int) -> None:
    rig = kit_rigs.get(backend)
    table = random_table(np.random.default_rng(rows), SRC_BYTES, DST_BYTES, rows, max_row)
    handle = rig.conn.write(rig.src_region, rig.remote, table)
    assert handle.nbytes == int(table[:, 2].sum())
    handle.wait(WAIT)
    assert handle.poll() is True
    assert_landed(rig.src, rig.dst, table)


def test_empty_table_is_a_notify_only_transfer(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    handle = rig.conn.write(rig.src_region, rig.remote, np.zeros((0, 3), np.int64), notify=b"only")
    handle.wait(WAIT)
    assert handle.nbytes == 0
    assert rig.wait_notes(1) == [(rig.tx.engine_id, b"only")]
    assert (rig.dst == CANARY).all()


BIG = np.iinfo(np.int64).max - 10
BAD_TABLES = [
    ("negative src offset", with_row([-1, 0, 10]), BoundsError, "row 1 has negative src_offset -1"),
    ("negative dst offset", with_row([0, -8, 10]), BoundsError, "row 1 has negative dst_offset -8"),
    ("zero-length row", with_row([0, 0, 0]), BoundsError, "row 1 has nbytes 0"),
    ("negative length", with_row([0, 0, -5]), BoundsError, "row 1 has nbytes -5"),
    ("past source end", with_row([SRC_BYTES - 4, 0, 8]), BoundsError,
     rf"past the source region's end \({SRC_BYTES} B"),
    ("past destination end", with_row([0, DST_BYTES - 4, 8]), BoundsError,
     rf"past the destination region's end \({DST_BYTES} B"),
    ("offset overflow", with_row([0, BIG, 100]), BoundsError, "past the destination region's end"),
    ("overlapping destinations", with_row([0, 5999, 10]), BoundsError,
     r"destination rows 0 \[1000, 6000\) and 1 \[5999, 6009\) overlap"),
    ("float dtype", good_table().astype(np.float64), BoundsError, "dtype int64, got float64"),
    ("wrong shape", good_table()[:, :2].copy(), BoundsError, r"shape \[n, 3\].*got \[1, 2\]"),
    ("not an array", [[0, 0, 10]], BoundsError, "numpy int64 array"),
]


@pytest.mark.parametrize("table,exc,match", [c[1:] for c in BAD_TABLES], ids=[c[0] for c in BAD_TABLES])
def test_bad_table_refused_before_any_byte_and_connection_still_usable(
    backend: Backend, kit_rigs: RigPool, table: np.ndarray, exc: type, match: str
) -> None:
    rig = kit_rigs.get(backend)
    with pytest.raises(exc, match=match):
        rig.conn.write(rig.src_region, rig.remote, table, notify=b"bad")
    assert_untouched_then_usable(rig)


BAD_TARGETS = ["unknown region", "stale length", "other engine", "other backend", "not a descriptor",
               "deregistered local region", "foreign local region"]


def _bad_target(rig: Rig, case: str) -> tuple[object, object, type, str]:
    d = rig.remote
    other = "tcp" if d["backend"] != "tcp" else "nixl"  # a backend name this rig's is not
    if case == "unknown region":
        return rig.src_region, {**d, "region": d["region"] + 1000}, RegistrationError, \
            f"no region {d['region'] + 1000}"
    if case == "stale length":
        return rig.src_region, {**d, "length": d["length"] + 1}, RegistrationError, "stale"
    if case == "other engine":
        return rig.src_region, rig.src_region.descriptor(), RegistrationError, \
            "connect to the engine that registered"
    if case == "other backend":
        return rig.src_region, {**d, "backend": other}, RegistrationError, \
            f"descriptor is for backend '{other}'"
    if case == "not a descriptor":
        return rig.src_region, [1, 2], RegistrationError, "must be a dict"
    if case == "deregistered local region":
        gone = rig.tx.register(torch.zeros(16, dtype=torch.uint8))
        rig.tx.deregister(gone)
        return gone, d, RegistrationError, "was deregistered"
    return rig.dst_region, d, RegistrationError, "was not registered with"


@pytest.mark.parametrize("case", BAD_TARGETS)
def test_bad_region_refused_before_any_byte_and_connection_still_usable(backend: Backend, kit_rigs: RigPool,
                                                                         case: str) -> None:
    rig = kit_rigs.get(backend)
    local, remote, exc, match = _bad_target(rig, case)
    with pytest.raises(exc, match=match):
        rig.conn.write(local, remote, good_table(), notify=b"bad")
    assert_untouched_then_usable(rig)


@pytest.mark.parametrize("notify,match", [(b"x" * (64 * 1024 + 1), "exceeds 65536 B"),
                                          ("text", "must be bytes")])
def test_bad_notify_refused_before_any_byte(backend: Backend, kit_rigs: RigPool, notify: object, match: str) -> None:
    rig = kit_rigs.get(backend)
    with pytest.raises(ProtocolError, match=match):
        rig.conn.write(rig.src_region, rig.remote, good_table(), notify=notify)
    assert_untouched_then_usable(rig)


def test_notify_arrives_after_all_data(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    table = random_table(np.random.default_rng(3), SRC_BYTES, DST_BYTES, 64, 60_000)
    seen: list[BaseException | None] = []

    def check(sender: str, payload: bytes) -> None:
        try:
            assert_landed(rig.src, rig.dst, table)
            seen.append(None)
        except AssertionError as exc:
            seen.append(exc)

    rig.on_notify = check
    rig.conn.write(rig.src_region, rig.remote, table, notify=b"after").wait(WAIT)
    # wait() returns only after the peer's handler has returned: no waiting here
    assert rig.notes == [(rig.tx.engine_id, b"after")]
    assert seen == [None], f"notify ran before the data landed: {seen}"


def test_notify_handler_error_does_not_break_the_link(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    def boom(sender: str, payload: bytes) -> None:
        raise RuntimeError("handler bug")

    rig.on_notify = boom
    rig.conn.write(rig.src_region, rig.remote, good_table(), notify=b"1").wait(WAIT)
    rig.on_notify = None
    rig.refill()
    assert_untouched_then_usable(rig)


def _slots(count: int, size: int, rows_each: int) -> list[np.ndarray]:
    """`count` tables, each `rows_each` rows of `size` B into its own destination slot."""
    rng = np.random.default_rng(count)
    stride = (size + 32) * rows_each
    out = []
    for i in range(count):
        dst = i * stride + np.arange(rows_each) * (size + 32)
        src = rng.integers(0, SRC_BYTES - size, rows_each)
        out.append(np.stack([src, dst, np.full(rows_each, size)], 1).astype(np.int64))
    return out


def test_100_concurrent_transfers_on_one_connection(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    tables = _slots(100, 20_000, 3)
    handles = [rig.conn.write(rig.src_region, rig.remote, t, notify=b"%d" % i)
               for i, t in enumerate(tables)]
    for h in handles:
        h.wait(WAIT)
    assert_landed(rig.src, rig.dst, np.concatenate(tables))
    notes = rig.wait_notes(100)
    assert sorted(int(p) for _, p in notes) == list(range(100))


def test_1000_small_transfers(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    tables = _slots(1000, 64, 2)
    handles = [rig.conn.write(rig.src_region, rig.remote, t) for t in tables]
    for h in handles:
        h.wait(WAIT)
    assert_landed(rig.src, rig.dst, np.concatenate(tables))


def test_register_refuses_same_or_overlapping_memory(backend: Backend, kit_rigs: RigPool) -> None:
    eng = kit_rigs.get(backend).tx
    buf = torch.zeros(1024, dtype=torch.float32)
    region = eng.register(buf)
    assert region.length == 4096 and region.device == "cpu"
    with pytest.raises(RegistrationError, match="is already registered"):
        eng.register(buf)
    with pytest.raises(RegistrationError, match=f"overlaps registered region {region.region_id}"):
        eng.register(buf[100:300])
    eng.deregister(region)
    eng.deregister(region)  # idempotent
    again = eng.register(buf[100:300])
    assert again.region_id != region.region_id and again.length == 800
    eng.deregister(again)


def test_deregister_keeps_nothing_alive(backend: Backend, kit_rigs: RigPool) -> None:
    # #19: once `deregister` returns, nothing of the engine — its links included — holds
    # the tensor, so a caller who frees a pool after deregistering it gets the memory back
    # while its links live. The region was announced to a live link and written into first
    # (a receiver that keeps regions a link may still write to would keep this one).
    # Watched through the numpy array under the tensor: its storage holds the array until
    # the memory itself is freed (a weakref to the tensor object alone dies with the caller's
    # handle even while a view of it keeps the bytes).
    rig = kit_rigs.get(backend)
    memory = np.full(1 << 16, CANARY, dtype=np.uint8)
    region = rig.rx.register(torch.from_numpy(memory))
    table = np.array([[0, 100, 5000]], np.int64)
    rig.conn.write(rig.src_region, region.descriptor(), table, notify=b"pool").wait(WAIT)
    rig.wait_note(b"pool")
    assert_landed(rig.src, memory, table)
    watch = weakref.ref(memory)
    rig.rx.deregister(region)
    del memory, region
    gc.collect()
    assert watch() is None, f"{backend.label}: the deregistered region's memory is still referenced"
    assert_untouched_then_usable(rig)  # the link lives on, and still moves the rig's region


@pytest.mark.parametrize("thing,match", [
    (torch.zeros(4, 4)[:, 0], "non-contiguous"),
    (torch.zeros(0), "empty tensor"),
    (np.zeros(4), "takes a torch.Tensor"),
], ids=["non-contiguous", "empty", "not a tensor"])
def test_register_refuses_what_it_cannot_address(backend: Backend, kit_rigs: RigPool, thing: object,
                                                 match: str) -> None:
    with pytest.raises(RegistrationError, match=match):
        kit_rigs.get(backend).tx.register(thing)


def test_descriptor_and_address_are_plain_msgpack(backend: Backend, kit_rigs: RigPool) -> None:
    rig = kit_rigs.get(backend)
    desc = rig.dst_region.descriptor()
    assert {"backend", "engine", "region", "length", "device"} <= set(desc)
    assert desc["engine"] == rig.rx.engine_id
    assert desc["length"] == DST_BYTES and desc["device"] == "cpu"
    for obj in (desc, rig.rx.address()):
        assert msgpack.unpackb(msgpack.packb(obj), strict_map_key=True) == obj
    assert rig.rx.address()["engine"] == rig.rx.engine_id


def test_readiness_for_host_memory_is_refused_before_anything_moves(backend: Backend, kit_rigs: RigPool) -> None:
    # `ready` is the CUDA stream contract (transport.streams); given for a host
    # region it reveals a caller who thinks its CPU bytes are produced
    # asynchronously, so every backend refuses it, and nothing lands.
    rig = kit_rigs.get(backend)
    table = np.array([[0, 0, 4096]], np.int64)
    with pytest.raises(CapabilityError, match="applies to CUDA memory only"):
        rig.conn.write(rig.src_region, rig.remote, table, notify=b"no", ready=object())
    rig.conn.write(rig.src_region, rig.remote, table, notify=b"yes").wait(WAIT)
    rig.wait_note(b"yes")
    assert [p for _, p in rig.notes] == [b"yes"]
    assert_landed(rig.src, rig.dst, table)


def test_cuda_round_trip(backend: Backend) -> None:
    need(backend, "cuda_memory")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    with Rig(backend) as rig:
        gpu = torch.full((DST_BYTES,), CANARY, dtype=torch.uint8, device="cuda")
        region = rig.rx.register(gpu)
        table = random_table(np.random.default_rng(5), SRC_BYTES, DST_BYTES, 100, 30_000)
        rig.conn.write(rig.src_region, region.descriptor(), table).wait(WAIT)
        assert_landed(rig.src, gpu.cpu().numpy(), table)
