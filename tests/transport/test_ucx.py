"""What is ucx's own, beyond the conformance kit (which runs over `ucx` and `ucx-all` from the registry).

* the fence, decided with real bytes in flight: a sender in another process
  streams a 64 MiB write; right after the first bytes land, our UCX thread
  is held while the sender fills our socket buffers, and `drop_peer` runs
  before that thread progresses anything again — so a fence that left the
  link's worker progressing would land those buffered bytes (and whatever
  the sender sends before it hears of the fence), and this test sees them;
* the two UCX facts the fence design rests on, asked of UCX itself
  (benchmarks/ucx_fence_probe.py): closing an endpoint on a worker that keeps
  progressing is no fence, and a sender-initiated rendezvous (put over cma)
  lands after the receiver retired its worker — why `ucx-all` says
  `fence=False`;
* the receiver never trusts an announce: out of region, overlapping or
  replayed runs end the link before one receive is posted;
* a write of more runs than one announce frame holds goes out in parts, and
  the run limit is refused before anything moves;
* importing UCXX leaves the process's UCX environment as it found it.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from pdxfer.transport.testing.forked import ForkedProcess

from pdxfer import transport

pytestmark = pytest.mark.skipif("ucx" not in transport.available(),
                                reason="ucxx-cu12 is not installed (pip install 'pdxfer[ucx]')")

HERE = Path(__file__).resolve().parent
WAIT = 30.0
NBYTES = 64 << 20
BUFFERED = 64 << 10  # bytes of the sender's that must wait in our socket buffers at the fence


def _readline(proc: ForkedProcess, timeout: float = WAIT) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the sender process said nothing in {timeout} s (exit code {proc.poll()})"
    return proc.stdout.readline().decode().strip()


def _our_sockets() -> list[list[str]]:
    """/proc/net/tcp{,6} rows of this process's TCP sockets."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows += [cols for cols in (line.split() for line in f.readlines()[1:]) if cols[9] in mine]
    return rows


def _queued_in_our_sockets() -> int:
    """Bytes received by the kernel for this process's TCP sockets and not read yet."""
    return sum(int(cols[4].split(":")[1], 16) for cols in _our_sockets())


def _listening() -> set[str]:
    """`address:port` (hex, as /proc shows it) of this process's listening TCP sockets."""
    return {cols[1] for cols in _our_sockets() if cols[3] == "0A"}


def _until(cond, timeout: float = WAIT) -> bool:
    tick = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if cond():
            return True
        tick.wait(0.005)
    return cond()


class _OneStep:
    """A worker whose `progress()` is one `progress_once()` (the rest of its surface as is)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def progress(self) -> None:
        self.worker.progress_once()

    def arm(self) -> bool:
        return self.worker.arm()


def _one_step_at_a_time(progress, worker) -> None:
    progress._workers[id(worker)] = _OneStep(worker)  # on the progress thread (`ask`)


def test_drop_peer_fences_a_receive_with_bytes_in_flight(monkeypatch) -> None:
    with transport.create("ucx") as rx:
        dst = np.zeros(NBYTES, np.uint8)
        region = rx.register(torch.from_numpy(dst))
        fenced: dict = {}
        done = threading.Event()

        def hold_then_fence() -> None:
            # On the UCX thread, right after the pass that landed the first bytes: nothing is
            # progressed while the sender fills our socket buffers, and the fence runs before
            # anything is progressed again.
            # bounded: a sender that has nothing left to send (or no CPU) must not hold us here
            fenced["buffered"] = _until(lambda: _queued_in_our_sockets() >= BUFFERED, 5.0)
            try:
                rx.drop_peer(fenced["sender"])
                fenced["dst"] = dst.copy()
            finally:
                done.set()

        passes = rx.progress._complete

        def gated_pass() -> None:  # the loop calls this after every progress pass
            passes()
            if "sender" in fenced and "dst" not in fenced and dst[::4096].any():
                hold_then_fence()

        monkeypatch.setattr(rx.progress, "_complete", gated_pass)
        # forked from the preloaded server (transport.testing.forked; UCXX is imported in the
        # child, as in a new interpreter): seconds less to start
        child = ForkedProcess(script=str(HERE / "ucx_sender.py"), args=[str(NBYTES)], text=False)
        try:
            info = {"address": rx.address(), "descriptor": region.descriptor()}
            child.stdin.write(msgpack.packb(info).hex().encode() + b"\n")
            child.stdin.flush()
            fenced["sender"] = sender = _readline(child).split()[1]
            assert _readline(child) == "connected"
            # UCXX's progress() drains all that arrived, which may be the whole write: the
            # link's worker is progressed one step per pass, so a pass lands part of it
            link = next(x for x in rx.inbound.links() if x.sender == sender)
            rx.progress.ask(lambda: _one_step_at_a_time(rx.progress, link.worker), WAIT, "a swap")
            child.stdin.write(b"go\n")
            child.stdin.flush()
            # The sender goes on sending until it hears of the fence, then fails its write.
            assert _readline(child) == "failed PeerLostError"
            assert done.wait(WAIT), "the held fence never finished"
            # usually >= 64 KiB of the sender's bytes wait in our socket at the fence (what a
            # broken fence lands at once); where not, what the sender sends on until it hears
            # of the fence is what would land
            print("bytes waiting in our sockets at the fence:", fenced["buffered"])
            at_fence = fenced["dst"]
            landed = int(np.count_nonzero(at_fence))
            assert 0 < landed < NBYTES, f"{landed} of {NBYTES} B at the fence: not mid-transfer"
            for _ in range(3):  # passes of our UCX thread: a broken fence lands bytes here
                rx.progress.ask(lambda: None, WAIT, "a progress pass")
            changed = int(np.count_nonzero(dst != at_fence))
            assert changed == 0, f"{changed} B landed after drop_peer returned"
            assert not rx.has_peer(sender)
            # The cost, as documented: the receive under way keeps its worker allocated.
            assert rx.abandoned_workers == 1
        finally:
            child.kill()
            child.wait()


class _FenceAtDeliveryStart:
    """`threading` for `ucx.inbound`, whose delivery thread's `start()` first fences its link.

    The fence runs on a thread of its own, from the moment the link's
    control thread starts that delivery thread: the window in which a fence
    once found the thread made and not yet started (`stop_path` joined it:
    "cannot join thread before it is started"). The fence is let finish
    first unless the starting thread holds the lock `stop_path` takes (then
    it would wait for us: we start, and it goes on after).
    """

    def __init__(self, link_of) -> None:
        self.fences: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.entered = threading.Event()
        self.delivery: list[threading.Thread] = []
        outer = self

        class Thread(threading.Thread):
            def start(self) -> None:
                if not self.name.startswith("ucx-notify"):
                    return super().start()
                link = link_of()
                outer.delivery.append(self)
                fence = threading.Thread(target=outer._fence, args=(link,), daemon=True)
                outer.fences.append(fence)
                fence.start()
                assert outer.entered.wait(WAIT), "the fence never reached stop_path"
                if link._lock.acquire(blocking=False):  # not ours: the fence will not wait for us
                    link._lock.release()
                    fence.join(WAIT)
                super().start()

        self.Thread = Thread

    def _fence(self, link) -> None:
        try:
            link.fence()
        except BaseException as exc:  # handed to the test
            self.errors.append(exc)

    def __getattr__(self, name: str):
        return getattr(threading, name)


def test_a_fence_at_the_moment_the_delivery_thread_starts_never_joins_an_unstarted_thread(
        monkeypatch) -> None:
    from pdxfer.transport.ucx import inbound

    with transport.create("ucx") as rx, transport.create("ucx") as tx:
        hook = _FenceAtDeliveryStart(lambda: next(x for x in rx.inbound.links() if x.sender))
        stop_path = inbound.UcxInbound.stop_path

        def entered(link) -> None:
            hook.entered.set()
            stop_path(link)

        monkeypatch.setattr(inbound.UcxInbound, "stop_path", entered)
        monkeypatch.setattr(inbound, "threading", hook)
        try:
            tx.connect(rx.address())
        except transport.TransportError:
            pass  # fenced in its handshake: refused, or severed right after the welcome
        assert hook.fences, "no delivery thread was started: the hook never ran"
        for fence in hook.fences:
            fence.join(WAIT)
            assert not fence.is_alive(), "the fence never finished"
        assert not hook.errors, f"the fence failed: {hook.errors!r}"
        assert _until(lambda: not rx.has_peer(tx.engine_id))
        for thread in hook.delivery:  # started under the fence's lock, then ended by it
            thread.join(WAIT)
            assert not thread.is_alive()


# -- UCX itself: why the fence is per-link worker retirement, and why ucx-all cannot fence ------

@pytest.fixture
def probe(monkeypatch):
    """benchmarks/ucx_fence_probe.py, importable by the processes it spawns."""
    monkeypatch.syspath_prepend(str(HERE.parents[1] / "benchmarks"))
    import ucx_fence_probe

    return ucx_fence_probe


def test_closing_an_endpoint_is_no_fence_for_a_worker_that_keeps_progressing(probe) -> None:
    # The sender stalls on (capped) socket buffers before the receiver progresses at all, so
    # the message is mid-flight at the fence; after it the sender runs until its send ends.
    out = probe.probe(probe.Case("tcp", "auto", "inf", "endpoint", 16 << 20), run_after=WAIT,
                      timeout=2 * WAIT)
    assert not out.sent_at_pause and 0 < out.landed_at_fence < 16 << 20, (
        f"not mid-transfer at the fence: {out}")
    assert out.leaked > 0, f"nothing landed after the endpoint was closed: {out}"


def test_a_sender_written_rendezvous_lands_after_the_receiver_retired_its_worker(probe) -> None:
    out = probe.probe(probe.Case("all", "put_zcopy", "8192", "worker", 16 << 20), timeout=WAIT)
    assert out.leaked > 0, f"nothing landed after the worker was retired: {out}"


# -- the receiver's checks of an announce ------------------------------------------------------------

@pytest.fixture
def raw_sender():
    """A receiving ucx engine, its canary-filled region, and a control socket speaking its wire."""
    from pdxfer.transport.ucx import lib, wire

    with transport.create("ucx") as rx:
        dst = np.full(1 << 20, 0x5A, np.uint8)
        region = rx.register(torch.from_numpy(dst))
        ctx = lib.context("tcp", "lo")
        worker = lib.worker(ctx)
        addr = rx.address()
        sock = socket.create_connection((addr["host"], addr["port"]), timeout=WAIT)
        mine = lib.worker_address(worker)
        wire.CONTROL.send(sock, wire.Hello("raw-sender", mine, lib.address_sum(mine)))
        welcome = wire.CONTROL.recv(sock)
        assert isinstance(welcome, wire.Welcome)
        try:
            yield rx, dst, region, sock, wire
        finally:
            sock.close()
            del worker, ctx


def _announce(wire, transfer: int, region: int, runs: list[list[int]]):
    raw = np.array(runs, dtype="<i8").tobytes()
    return wire.Announce(transfer, region, 0, len(runs), raw, None)


@pytest.mark.parametrize("runs,transfer,match", [
    ([[1 << 20, 16]], 1, "outside the 1048576 B region"),
    ([[0, 4096], [4000, 100]], 1, "overlap"),
    ([[0, -5]], 1, "outside"),
], ids=["past the end", "overlapping", "negative length"])
def test_an_announce_the_region_cannot_hold_ends_the_link_before_any_receive(
        raw_sender, runs, transfer, match) -> None:
    from pdxfer.transport.wire import ErrorMessage

    rx, dst, region, sock, wire = raw_sender
    wire.CONTROL.send(sock, _announce(wire, transfer, region.region_id, runs))
    reply = wire.CONTROL.recv(sock)
    assert isinstance(reply, ErrorMessage) and match in reply.reason
    assert _until(lambda: not rx.has_peer("raw-sender"))
    assert (dst == 0x5A).all()


def test_a_hello_with_a_worker_address_ucx_cannot_read_is_refused_and_the_engine_lives() -> None:
    # UCX aborts the process on an address of an unknown version; the engine must never hand one over
    # (its checksum right: what a forger who knows the wire sends; corruption: test_ucx_hostile_address)
    from pdxfer.transport.testing.rig import Backend, PeerProcess
    from pdxfer.transport.ucx import lib, wire
    from pdxfer.transport.wire import ErrorMessage

    peer = PeerProcess(Backend.named("ucx"), 1 << 20)
    try:
        host, port = peer.address["host"], peer.address["port"]
        # an unknown address version, nothing, noise of a known version
        for garbage, match in ((b"\x03" + bytes(40), "not in this UCX's format"),
                               (b"", "outside 16..2048 B"),
                               (bytes(range(256)) * 4, "no UCX endpoint to the worker address")):
            with socket.create_connection((host, port), timeout=WAIT) as sock:
                wire.CONTROL.send(sock, wire.Hello("hostile", garbage, lib.address_sum(garbage)))
                reply = wire.CONTROL.recv(sock)
            assert isinstance(reply, ErrorMessage), reply
            assert match in reply.reason, reply.reason
        with transport.create("ucx") as tx:  # the peer process still serves
            src = tx.register(torch.ones(4096, dtype=torch.uint8))
            tx.connect(peer.address).write(src, peer.descriptor, np.array([[0, 0, 4096]], np.int64)).wait(WAIT)
        assert peer.child.poll() is None
    finally:
        peer.kill()


def test_a_replayed_transfer_number_ends_the_link(raw_sender) -> None:
    from pdxfer.transport.wire import ErrorMessage

    rx, dst, region, sock, wire = raw_sender
    wire.CONTROL.send(sock, wire.Announce(5, region.region_id, 0, 0, b"", b"first"))
    assert isinstance(wire.CONTROL.recv(sock), wire.Acks)  # a notify-only write: done at once
    wire.CONTROL.send(sock, _announce(wire, 5, region.region_id, [[128, 64]]))
    reply = wire.CONTROL.recv(sock)
    assert isinstance(reply, ErrorMessage) and "transfer number not new" in reply.reason
    assert (dst == 0x5A).all()


# -- writes in parts, and the run limit ---------------------------------------------------------------

def _pair():
    tx, rx = transport.create("ucx"), transport.create("ucx")
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(2 << 20, np.uint8)
    return tx, rx, src, dst, tx.register(torch.from_numpy(src)), rx.register(torch.from_numpy(dst))


def test_a_write_of_more_runs_than_one_frame_holds_is_announced_in_parts(monkeypatch) -> None:
    from pdxfer.transport.ucx import wire

    monkeypatch.setattr(wire, "MAX_ROWS", 3)
    tx, rx, src, dst, s, d = _pair()
    try:
        notes = []
        rx.set_notify_handler(lambda sender, payload: notes.append(payload))
        rows = np.arange(10, dtype=np.int64)
        table = np.stack([rows * 1000, rows * 3000, np.full(10, 700)], 1)  # 10 runs: 4 parts
        tx.connect(rx.address()).write(s, d.descriptor(), table, notify=b"parts").wait(WAIT)
        for so, do, n in table.tolist():
            assert (dst[do:do + n] == src[so:so + n]).all()
        assert notes == [b"parts"]
    finally:
        tx.close()
        rx.close()


def test_more_runs_than_a_write_may_tag_are_refused_before_anything_moves(monkeypatch) -> None:
    from pdxfer.transport.ucx import lib

    monkeypatch.setattr(lib, "MAX_RUNS", 4)
    tx, rx, src, dst, s, d = _pair()
    try:
        rows = np.arange(5, dtype=np.int64)
        table = np.stack([rows * 100, rows * 300, np.full(5, 50)], 1)
        conn = tx.connect(rx.address())
        with pytest.raises(transport.BoundsError, match="at most 4 runs.*this table has 5"):
            conn.write(s, d.descriptor(), table)
        assert not dst.any()
        conn.write(s, d.descriptor(), table[:4]).wait(WAIT)  # the link is still good
    finally:
        tx.close()
        rx.close()


def test_ucx_listens_only_on_the_interface_of_the_host_given() -> None:
    before = _listening()
    with transport.create("ucx", host="127.0.0.1") as tx, transport.create("ucx", host="127.0.0.1") as rx:
        assert tx.device == "lo"
        tx.connect(rx.address())  # the receiver's link worker listens too
        opened = _listening() - before
        # the control listener, the sending workers' and the link worker's UCX listeners
        assert len(opened) >= 4, opened
        assert all(a.startswith("0100007F:") for a in opened), opened  # 127.0.0.1


def test_importing_ucxx_leaves_the_ucx_environment_as_it_was() -> None:
    code = ("import os; before = {k: v for k, v in os.environ.items() if k.startswith('UCX_')}; "
            "import pdxfer.transport.ucx; "
            "after = {k: v for k, v in os.environ.items() if k.startswith('UCX_')}; "
            "before.setdefault('UCX_LOG_FILE', 'stderr'); print(before == after, sorted(after))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_TLS"] = "tcp"  # a user's choice survives, and nothing else appears
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=HERE.parents[1])
    assert out.stdout.split()[0] == "True", out.stdout + out.stderr


def test_an_owned_ucx_object_dies_on_the_ucx_thread_whoever_drops_it_last() -> None:
    # What `Progress.own` is for: a worker or endpoint dropped (or collected) on another
    # thread must not run its UCX destructor there while the UCX thread drives the context.
    from pdxfer.transport.ucx.progress import Progress

    progress = Progress("own-test")
    try:
        died_on: list[str] = []
        done = threading.Event()

        class Thing:  # stands in for a UCXX object: a finalizer says where it died
            pass

        box = [Thing()]
        weakref.finalize(box[0], lambda: (died_on.append(threading.current_thread().name), done.set()))
        progress.ask(lambda: progress.own(box[0]) and None, WAIT, "owning")
        box.clear()  # the last reference but the UCX thread's, dropped on this thread
        progress.kick()
        assert done.wait(WAIT), "the owned object never died"
        assert died_on == ["own-test-progress"]
    finally:
        progress.stop()
