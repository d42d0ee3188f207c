"""What only the nixl backend has: its metadata refresh, its fence configuration, its frames.

Everything in the transport contract is pinned by the conformance suite,
which runs over nixl because it is in `transport.available()`; these tests
cover the mechanisms nixl adds to meet it.
"""

from __future__ import annotations

import dataclasses
import gc
import ipaddress
import os
import pathlib
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError, ProtocolError, RegistrationError, TransportError
from pdxfer.transport.testing import Backend, Rig
from pdxfer.transport.testing.rig import WAIT
from pdxfer.transport.testing.tables import CANARY, assert_landed

from pdxfer import transport

pytestmark = pytest.mark.skipif(
    "nixl" not in transport.available(), reason="nixl-cu12 is not installed (pip install nixl-cu12)"
)


@pytest.fixture
def rig():
    r = Rig(Backend.named("nixl"))
    try:
        yield r
    finally:
        r.close()


def test_region_registered_after_connecting_is_reachable(rig: Rig) -> None:
    # The link's metadata predates this region: the write must refresh it, not fail.
    late = np.full(1 << 16, CANARY, dtype=np.uint8)
    region = rig.rx.register(torch.from_numpy(late))
    table = np.array([[0, 100, 5000], [9000, 30_000, 20_000]], np.int64)
    rig.conn.write(rig.src_region, region.descriptor(), table, notify=b"late").wait(WAIT)
    assert_landed(rig.src, late, table)
    rig.wait_note(b"late")
    # ... and the old region still works on the refreshed link.
    good = np.array([[0, 0, 4096]], np.int64)
    rig.conn.write(rig.src_region, rig.remote, good).wait(WAIT)
    assert_landed(rig.src, rig.dst, good)


def test_deregistered_region_is_refused_once_the_sender_hears(rig: Rig) -> None:
    extra = torch.zeros(4096, dtype=torch.uint8)
    region = rig.rx.register(extra)
    desc = region.descriptor()
    rig.conn.write(rig.src_region, desc, np.array([[0, 0, 16]], np.int64)).wait(WAIT)
    rig.rx.deregister(region)
    rig.rx.deregister(region)  # idempotent
    deadline = time.monotonic() + WAIT
    while True:  # `Gone` travels asynchronously on the control connection
        try:
            rig.conn.write(rig.src_region, desc, np.array([[0, 0, 16]], np.int64)).wait(WAIT)
        except RegistrationError as exc:
            assert f"no region {desc['region']}" in str(exc)
            break
        assert time.monotonic() < deadline, "the sender never heard the region was deregistered"
        time.sleep(0.01)


def test_a_write_never_waits_for_the_agent_lock(rig: Rig) -> None:
    # #8: the initiating agent is shared by every peer, and some NIXL calls on it
    # (loading a new peer's metadata, forgetting a dead one) run for tens of ms.
    # Another thread holds the agent lock here as such a call would; the write must
    # return while it is held — posting is the progress thread's job — and land after.
    held, returned, saw_return = threading.Event(), threading.Event(), []

    def long_nixl_call() -> None:
        with rig.tx._initiator.lock:
            held.set()
            saw_return.append(returned.wait(WAIT))

    holder = threading.Thread(target=long_nixl_call)
    holder.start()
    assert held.wait(WAIT)
    table = np.array([[0, 0, 4096], [8192, 20_000, 3000]], np.int64)
    handle = rig.conn.write(rig.src_region, rig.remote, table, notify=b"while-held")
    returned.set()
    holder.join(WAIT)
    assert saw_return == [True], "write() waited for the agent lock another thread held"
    handle.wait(WAIT)
    assert_landed(rig.src, rig.dst, table)
    rig.wait_note(b"while-held")


def test_close_fences_the_link_on_the_receiver(rig: Rig) -> None:
    rig.conn.write(rig.src_region, rig.remote, np.array([[0, 0, 64]], np.int64)).wait(WAIT)
    assert [p.sender for p in rig.rx.inbound.links()] == [rig.tx.engine_id]
    rig.conn.close()
    deadline = time.monotonic() + WAIT
    while rig.rx.inbound.links():  # the receiver's fence follows our Bye
        assert time.monotonic() < deadline, "receiver kept the closed link's agent"
        time.sleep(0.01)


def test_transports_that_cannot_be_fenced_make_drop_peer_refuse() -> None:
    with transport.create("nixl", tls="all") as engine:
        with pytest.raises(CapabilityError, match="cannot fence a peer.*use tls='tcp'"):
            engine.drop_peer("nixl-someone")


def test_a_ucx_transport_list_nixl_would_cut_is_refused() -> None:
    # NIXL passes `TLS=tcp,bogus` to UCX as `TLS=tcp`: a list would be silently cut.
    with pytest.raises(CapabilityError, match=r"tls='tcp,cma'.*cuts a UCX transport list.*'all'"):
        transport.create("nixl", tls="tcp,cma")


def test_unknown_ucx_transport_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match="cannot start a NIXL agent with UCX transports 'bogus'"):
        transport.create("nixl", tls="bogus")


def test_notification_frames_round_trip_and_refuse_garbage() -> None:
    from pdxfer.transport.nixl.wire import pack_note, unpack_note

    note = unpack_note(pack_note(7, b"payload"))
    assert (note.seq, note.payload) == (7, b"payload")
    assert unpack_note(pack_note(8, None)).payload is None
    with pytest.raises(ProtocolError, match="undecodable"):
        unpack_note(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack_note(b"x" * (200 * 1024))


def test_ucx_log_lines_never_reach_stdout() -> None:
    # a worker's stdout is its protocol channel; UCX prints its log there by default
    env = {**os.environ, "UCX_LOG_LEVEL": "debug"}
    env.pop("UCX_LOG_FILE", None)
    child = pathlib.Path(__file__).with_name("ucx_quiet.py")
    proc = subprocess.run([sys.executable, str(child)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "DONE\n", proc.stdout[:2000]
    assert "UCX" in proc.stderr  # the log was written — to stderr


def _listening_ports() -> set[str]:
    """`addr:port` of every TCP socket this process listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in pathlib.Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for name, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    hexaddr, port = cols[1].split(":")
                    raw = bytes.fromhex(hexaddr)
                    # /proc prints each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                    out.add(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
    return out


def test_ucx_listens_only_on_the_interface_of_the_host_given() -> None:
    before = _listening_ports()
    with transport.create("nixl", host="127.0.0.1") as eng:
        assert eng.device == "lo"
        opened = _listening_ports() - before
        assert opened, "the engine opened no listener at all?"
        assert all(a.startswith("127.") for a in opened), opened


def test_capabilities_follow_the_ucx_transports_per_instance() -> None:
    # tcp: host memory, receiver-driven, fenceable. UCX's full list: VRAM
    # (cuda_ipc/cuda_copy where present), one-sided (cma here) — no fence.
    from pdxfer.transport.nixl.agent import cuda_tls

    with transport.create("nixl") as tcp, transport.create("nixl-all") as full, \
            transport.create("nixl", tls=None) as default:
        assert (tcp.tls, full.tls, default.tls) == ("tcp", "all", "all")
        assert transport.capabilities("nixl-all") == full.capabilities  # #25 item 7
        assert not tcp.capabilities.cuda_memory and not tcp.capabilities.one_sided
        assert full.capabilities.cuda_memory and full.capabilities.one_sided
        assert type(tcp).capabilities.cuda_memory is False  # the class keeps tcp's answer
    assert cuda_tls("cuda_ipc") and cuda_tls("all") and not cuda_tls("tcp") and not cuda_tls("cma")


def test_region_rows_name_each_regions_device_for_vram_descriptors() -> None:
    from pdxfer.transport.nixl.send import descs
    from pdxfer.transport.nixl.wire import mem_type, region_rows

    with transport.create("nixl-all") as eng:
        region = eng.register(torch.zeros(4096, dtype=torch.uint8))
        rows = np.frombuffer(region_rows([region]), dtype="<i8").reshape(-1, 4)
        assert rows.tolist() == [[region.region_id, region.start, 4096, -1]]
    assert (mem_type(-1), mem_type(0), mem_type(3)) == ("DRAM", "VRAM", "VRAM")
    assert descs(1000, np.array([[5, 7, 9]], np.int64), 1, 3).tolist() == [[1007, 9, 3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine")
def test_tcp_only_nixl_refuses_vram_and_the_full_list_registers_it() -> None:
    gpu = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with transport.create("nixl") as tcp:
        with pytest.raises(CapabilityError, match="cannot register CUDA memory"):
            tcp.register(gpu)
    with transport.create("nixl-all") as full:
        assert full.register(gpu).descriptor()["device"] == "cuda"


# -- #23: prepared descriptor lists, one registration per engine without a fence --------------


def test_a_requests_rows_and_a_large_tables_rows_cut_into_the_same_blocks() -> None:
    from pdxfer.transport.nixl import requests as nixl_requests

    rng = np.random.default_rng(23)
    for _ in range(20):
        block = 1 << int(rng.integers(9, 16))
        n = int(rng.integers(1, 40))
        lengths = rng.integers(1, 5, n) * block
        table = np.stack([rng.permutation(4096)[:n] * block * 4, rng.permutation(4096)[:n] * block * 4,
                          lengths], 1).astype(np.int64)
        small = nixl_requests.blocks(table)  # plain ints (<= SMALL rows)
        big = nixl_requests.blocks(np.concatenate([table] * 5))  # vectorised
        assert small[0] == big[0] == int(np.bitwise_or.reduce(table.reshape(-1)) & -np.bitwise_or.reduce(
            table.reshape(-1)))
        assert np.array_equal(np.tile(small[1], 5), big[1]) and np.array_equal(np.tile(small[2], 5), big[2])
        assert small[1].shape[0] == int(lengths.sum() // small[0])  # one index per block covered


class _List:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


def test_prepared_lists_stay_within_their_budget_least_recently_used_released_first() -> None:
    from pdxfer.transport.nixl.agent import Prepared

    prepared = Prepared(budget=100)
    lists = {k: _List() for k in "abc"}
    prepared.get("a", lambda: (lists["a"], 40))
    prepared.get("b", lambda: (lists["b"], 40))
    assert prepared.get("a", lambda: pytest.fail("prepared twice")) is lists["a"]  # a is now newest
    prepared.get("c", lambda: (lists["c"], 40))  # 120 > 100: b, the least recently used, goes
    assert lists["b"].released and not lists["a"].released and prepared.descs == 80
    prepared.drop(lambda key: key == "a")
    assert lists["a"].released and prepared.descs == 40 and len(prepared) == 1


@pytest.mark.parametrize("tls,per_link", [("tcp", True), ("all", False)])
def test_registrations_per_link_only_where_the_link_is_fenced(tls: str, per_link: bool) -> None:
    rx = transport.create("nixl", tls=tls)
    senders = [transport.create("nixl", tls=tls) for _ in range(2)]
    try:
        dst = np.full(1 << 20, CANARY, dtype=np.uint8)
        d = rx.register(torch.from_numpy(dst))
        got = threading.Semaphore(0)
        rx.set_notify_handler(lambda sender, payload: got.release())
        for i, tx in enumerate(senders):
            src = np.full(4096, i + 1, dtype=np.uint8)
            s = tx.register(torch.from_numpy(src))
            tx.connect(rx.address()).write(s, d.descriptor(), np.array([[0, i * 4096, 4096]]),
                                           notify=b"n").wait(WAIT)
        for _ in senders:
            assert got.acquire(timeout=WAIT)
        use = rx.usage()
        assert use["links_in"] == 2
        # one registration of the region on the engine's agent, plus one per link that is fenced
        assert use["registrations"] == (1 + 2 if per_link else 1)
        assert use["agents"] == (1 + 2 if per_link else 1)
        assert all((dst[i * 4096:(i + 1) * 4096] == i + 1).all() for i in range(2))
    finally:
        for engine in (*senders, rx):
            engine.close()


def _deregister_while_posting_is_held(rig: Rig, memory: np.ndarray, region, fence_wait: float):
    """Deregister `region` on the receiver while the sender's agent lock is held, so a write the
    sender accepted before `Gone` sits in its request queue; `(snapshot at return, thread)`.

    The lock is held until the sender's reader waits for that write (`Requests.settled`) and
    deregister has had `fence_wait` s to return early, as a broken wait would.
    """
    requests = rig.tx._requests
    settling, snapshot = threading.Event(), []
    real = requests.settled

    def settled(*args):
        settling.set()
        return real(*args)

    requests.settled = settled

    def deregister() -> None:
        rig.rx.deregister(region)
        snapshot.append(memory.copy())

    with rig.tx._initiator.lock:  # the progress thread cannot post: the write waits, counted
        handle = rig.conn.write(rig.src_region, region.descriptor(), np.array([[0, 0, 50_000]], np.int64))
        thread = threading.Thread(target=deregister)
        thread.start()
        assert settling.wait(WAIT), "the sender never waited for its writes into the region"
        thread.join(fence_wait)  # a receiver that does not wait for the ack returns here
    return handle, snapshot, thread


def test_a_write_posted_before_gone_lands_before_deregister_returns(rig: Rig) -> None:
    # #19: deregister lets the memory go only once the sender said no write naming the region
    # is left (GoneAck): the write it had accepted is posted, lands, and only then do we return.
    memory = np.full(1 << 16, CANARY, dtype=np.uint8)
    region = rig.rx.register(torch.from_numpy(memory))
    rig.conn.write(rig.src_region, region.descriptor(), np.array([[0, 0, 16]], np.int64)).wait(WAIT)
    memory[:] = CANARY
    handle, snapshot, thread = _deregister_while_posting_is_held(rig, memory, region, 0.5)
    thread.join(WAIT)
    assert not thread.is_alive(), "deregister never returned"
    assert_landed(rig.src, snapshot[0], np.array([[0, 0, 50_000]], np.int64))
    handle.wait(WAIT)
    assert rig.rx.inbound.links() and rig.conn.alive, "an acknowledged Gone must not cost the link"
    assert all(region.region_id not in p.held for p in rig.rx.inbound.links())
    with pytest.raises(RegistrationError, match=f"no region {region.region_id}"):
        rig.conn.write(rig.src_region, region.descriptor(), np.array([[0, 0, 16]], np.int64))


def test_a_sender_that_does_not_acknowledge_gone_is_fenced() -> None:
    # The sender's write stays unposted past both bounds (its agent lock held): no GoneAck comes,
    # so the receiver fences the link (nothing of it can land) and lets the memory go.
    with Rig(Backend.named("nixl"), connect_timeout=1.0) as rig:
        memory = np.full(1 << 16, CANARY, dtype=np.uint8)
        region = rig.rx.register(torch.from_numpy(memory))
        rig.conn.write(rig.src_region, region.descriptor(), np.array([[0, 0, 16]], np.int64)).wait(WAIT)
        watch = weakref.ref(memory)
        # The sender gives up first (0.2 s, the receiver 1 s): a sender that acknowledged anyway
        # would be believed, and the link would not be fenced.
        rig.conn.ctx = dataclasses.replace(rig.conn.ctx, connect_timeout=0.2)
        handle, _, thread = _deregister_while_posting_is_held(rig, memory, region, WAIT)
        assert not thread.is_alive(), "deregister did not return within its bound"
        assert not rig.rx.inbound.links(), "the link that did not answer was not fenced"
        del memory, region, _
        gc.collect()
        assert watch() is None, "the fenced link still keeps the deregistered memory"
        with pytest.raises(TransportError):
            handle.wait(WAIT)


def test_a_write_still_waiting_for_its_producer_at_gone_is_refused_not_posted(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # A write checked before `Gone` but not yet handed to NIXL (its producer's event pending)
    # is not counted by the GoneAck: `submit` must refuse it once the region is gone.
    from pdxfer.transport import link as link_module
    from pdxfer.transport.testing.cases_engine import Producer

    real = link_module.capture
    monkeypatch.setattr(link_module, "capture",
                        lambda ready, device: ready if isinstance(ready, Producer) else real(ready, device))
    memory = np.full(1 << 16, CANARY, dtype=np.uint8)
    region = rig.rx.register(torch.from_numpy(memory))
    producer = Producer()
    handle = rig.conn.write(rig.src_region, region.descriptor(), np.array([[0, 0, 4096]], np.int64),
                            ready=producer)
    assert producer.asked.wait(WAIT)
    rig.rx.deregister(region)  # acknowledged at once: nothing naming it was handed to NIXL
    producer.reached.set()
    with pytest.raises(RegistrationError, match=f"deregistered region {region.region_id} before write"):
        handle.wait(WAIT)
    assert (memory == CANARY).all()


def test_close_keeps_the_agents_while_the_progress_thread_is_inside_a_round() -> None:
    """Destroying a NIXL agent under a running round aborted the process ("Fatal Python error:
    Aborted" in the suite: close in agent teardown while the thread was in `get_new_notifs`).

    A round held past the 2 s stop bound (its poll blocked, as a slow NIXL call on a loaded host
    holds it): the first close() must leave the agents alone, and a close() after the round
    ended finishes the job.
    """
    rx = transport.create("nixl")
    requests = rx._requests
    poll, entered, leave = requests.poll, threading.Event(), threading.Event()

    def slow_poll(*args, **kwargs):
        entered.set()
        leave.wait(60)
        return poll(*args, **kwargs)

    requests.poll = slow_poll
    try:
        rx._progress.kick()
        assert entered.wait(WAIT)
        rx.close()  # the round is still inside: the release step stays unfinished
        assert rx._initiator.agent is not None, "the agent was destroyed under a running round"
    finally:
        leave.set()
    rx.close()  # the round ends within the stop bound: now the agents go
    assert rx._initiator.agent is None
