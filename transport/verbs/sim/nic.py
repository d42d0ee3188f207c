"""The software RDMA NIC behind `sim/verbs.py`: one thread executing work requests as RC would.

Why a NIC of our own: no userspace-only libibverbs provider exists (rxe and
siw need kernel modules this machine lacks), yet the verbs backend's hard
parts — ordering, the fence, limits, completion errors — must be tested in
every `make test`. So this module models the parts of an RC HCA the backend
relies on, as documented (ibv_post_send(3), ibv_poll_cq(3), the IBA's QP
state machine, the mlx5 MR revoke contract), and nothing more:

- Work runs on the fabric's own thread, per QP in post order, so posted WRs
  keep landing while the posting thread is blocked or stalled.
- Bytes move in `packet`-sized pieces copied by `ctypes.memmove` *outside*
  the fabric lock. State is re-checked between packets: a QP moved to ERR
  stops at the next packet boundary — a packet already on the wire still
  lands after `modify` returned, as on hardware — while `MR.close()` waits
  until no packet touching that MR is in flight, then invalidates its keys.
  So a fence made of QP->ERR alone is caught; one that deregisters is not.
- lkey/rkey, PD, access flags and bounds are enforced (LOC_PROT_ERR,
  REM_ACCESS_ERR with both QPs to ERR). A SEND with no receive posted is
  retried as RNR (rnr_retry 7 = forever) and a responder that is gone or cut
  off gives RETRY_EXC_ERR after `retry_timeout`. A full CQ puts its QPs in
  ERR (the CQ overrun). Error completions carry only wr_id/status/qp_num/
  vendor_err; after an error every outstanding WR completes WR_FLUSH_ERR.
- Addressing (`net.Network`): a request reaches its responder only if the
  requester's address vector (GID, type, hop limit; LID on InfiniBand)
  leads to the responder's port, and its ACK comes back only if the
  responder's leads back; otherwise the requester retries and fails
  `RETRY_EXC_ERR`, as on a routed fabric.
- GPU memory (`gpu.CudaDouble`): a dma-buf MR maps its export's pages
  itself (its address space is the dma-buf offset, as pyverbs 44 sets
  iova); packets placed into memory of a GPU that does not order NIC writes
  are counted until that GPU is flushed.
- Fault injection: `pause(qpn)`, `fail_next(qpn, status)`, `cut(a, b)`, and
  `on_packet`, a hook run on the NIC thread before each packet's copy.

Not modelled: PSN arithmetic, MTU-sized packets, UD/UC, reads, atomics,
inline data, memory windows — the backend uses none of them.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pdxfer.transport.verbs.sim.gpu as gpu_double  # absolute: `from . import` runs sim/__init__
import pdxfer.transport.verbs.sim.net as net

# Values as in rdma-core's ibv_wc_status / ibv_qp_state / ibv_wc_opcode (the
# honesty test compares them with real pyverbs).
SUCCESS, LOC_LEN_ERR, LOC_PROT_ERR, WR_FLUSH_ERR = 0, 1, 4, 5
REM_INV_REQ_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR, RNR_RETRY_EXC_ERR = 9, 10, 12, 13
RESET, INIT, RTR, RTS, ERR = 0, 1, 2, 3, 6
WC_SEND, WC_RDMA_WRITE, WC_RECV = 0, 1, 128
OP_WRITE, OP_SEND = 0, 2
REMOTE_WRITE = 2
INFLIGHT_WAIT = 30.0  # MR.close waits this long for a packet; only a hung hook exceeds it


# The fabric's NIC thread: it stands for the hardware, is shared by every
# engine of the process and outlives them (as a NIC outlives its users).
NIC_THREAD = "soft-verbs-nic"


@dataclass
class MRState:
    key: int
    pd: object
    addr: int
    length: int
    access: int
    live: bool = True
    shift: int = 0  # host address = MR address + shift (a dma-buf MR's addresses are offsets)
    gpu: int | None = None  # writes into it wait for this GPU's flush to be visible
    unmap: Callable[[], None] | None = None  # what to release after it is invalidated


@dataclass
class CQState:
    depth: int
    entries: collections.deque = field(default_factory=collections.deque)
    qps: list = field(default_factory=list)
    overrun: bool = False


@dataclass
class WQE:
    """A work request as the NIC holds it: fields copied at post time, like a WQE."""

    wr_id: int
    opcode: int
    signaled: bool
    sges: list  # [(addr, length, lkey)]
    rkey: int = 0
    raddr: int = 0
    total: int = 0
    done: int = 0
    checked: bool = False
    deadline: float | None = None  # retry / RNR deadline while the responder cannot take it
    recv: Any = None  # the consumed receive WQE of a SEND
    host: list = field(default_factory=list)  # [(host address, length)] of the SGEs, once checked


@dataclass
class QPState:
    qpn: int
    pd: object
    scq: CQState
    rcq: CQState
    max_send_wr: int
    max_recv_wr: int
    max_send_sge: int
    state: int = RESET
    access: int = 0
    dest: int = 0
    port: tuple = ("", 0)  # (device, port number), set at INIT
    ah: net.Ah = field(default_factory=net.Ah)  # the address vector, set at RTR
    rnr_retry: int = 7
    sq: collections.deque = field(default_factory=collections.deque)
    rq: collections.deque = field(default_factory=collections.deque)
    sq_used: int = 0  # WQEs posted and not yet reported back through a polled CQE
    rq_used: int = 0
    unreported: int = 0  # retired unsignaled WQEs a later CQE will free


class Fabric:
    """One process-wide software RDMA fabric: MR and QP tables and the NIC thread."""

    def __init__(self, topology: net.Topology | None = None, *, max_qp_wr: int = 256, max_sge: int = 8,
                 max_msg_sz: int = 1 << 20, max_cqe: int = 4096, packet: int = 64 << 10,
                 retry_timeout: float = 0.5) -> None:
        self.max_qp_wr, self.max_sge, self.max_msg_sz = max_qp_wr, max_sge, max_msg_sz
        self.max_cqe, self.packet, self.retry_timeout = max_cqe, packet, retry_timeout
        self.net = net.Network(topology or net.Topology())
        self.cuda = gpu_double.CudaDouble(self.net.topology.gpus)
        self.sysfs = tempfile.mkdtemp(prefix="soft-verbs-sysfs-")  # the host's PCIe tree, as sysfs shows it
        self.net.write_sysfs(self.sysfs)
        self._closed = False
        self.lock = threading.Condition()
        self.mrs: dict[int, MRState] = {}
        self.qps: dict[int, QPState] = {}
        self.inflight: collections.Counter = collections.Counter()
        self.closers_waiting = 0  # MR.close calls waiting on an in-flight packet (for tests)
        self.paused: set[int] = set()
        self.failing: dict[int, int] = {}
        self.cuts: set[frozenset] = set()
        self.doorbells: collections.Counter = collections.Counter()
        self.on_packet: Callable[[int, int], None] | None = None  # (qpn, dst key) before a copy
        self._keys = itertools.count(0x1000)
        self._qpns = itertools.count(0x20)
        self._rr = 0
        self._changed = False  # a step completed or failed a WR: look again before sleeping
        self._thread: threading.Thread | None = None

    # -- fault injection ----------------------------------------------------
    def pause(self, qpn: int, paused: bool = True) -> None:
        """Stop (or resume) executing `qpn`'s send queue, as a NIC stalled on it would."""
        with self.lock:
            (self.paused.add if paused else self.paused.discard)(qpn)
            self.lock.notify_all()

    def fail_next(self, qpn: int, status: int) -> None:
        """The next WR `qpn` executes completes with `status` and the QP goes to ERR."""
        with self.lock:
            self.failing[qpn] = status
            self.lock.notify_all()

    def cut(self, a: int, b: int) -> None:
        """No packet passes between QPs `a` and `b` any more: their WRs end RETRY_EXC_ERR."""
        with self.lock:
            self.cuts.add(frozenset((a, b)))
            self.lock.notify_all()

    # -- tables -------------------------------------------------------------
    def add_mr(self, pd: object, addr: int, length: int, access: int, **extra: Any) -> MRState:
        with self.lock:
            mr = MRState(next(self._keys), pd, addr, length, access, **extra)
            self.mrs[mr.key] = mr
            return mr

    def close_mr(self, mr: MRState) -> None:
        """Invalidate `mr` once no packet touching it is in flight (the revoke contract)."""
        with self.lock:
            if not mr.live:
                return
            self.closers_waiting += 1
            self.lock.notify_all()
            try:
                if not self.lock.wait_for(lambda: self.inflight[mr.key] == 0, INFLIGHT_WAIT):
                    raise TimeoutError(f"soft verbs: a packet into MR {mr.key:#x} never finished")
            finally:
                self.closers_waiting -= 1
            mr.live = False
            self.mrs.pop(mr.key, None)
        if mr.unmap is not None:
            mr.unmap()

    def add_qp(self, pd: object, scq: CQState, rcq: CQState, cap: Any) -> QPState:
        with self.lock:
            qp = QPState(next(self._qpns), pd, scq, rcq, cap.max_send_wr, cap.max_recv_wr,
                         cap.max_send_sge)
            self.qps[qp.qpn] = qp
            scq.qps.append(qp)
            rcq.qps.append(qp)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=NIC_THREAD)
                self._thread.start()
            return qp

    def destroy_qp(self, qp: QPState) -> None:
        with self.lock:
            self.qps.pop(qp.qpn, None)
            qp.state = ERR
            qp.sq.clear()
            qp.rq.clear()
            self.lock.notify_all()

    def set_state(self, qp: QPState, state: int) -> None:
        with self.lock:
            qp.state = state
            self.lock.notify_all()

    # -- posting ------------------------------------------------------------
    def post_send(self, qp: QPState, wqes: list[WQE]) -> int:
        """Queue `wqes` (one doorbell); returns how many fit before the SQ was full."""
        with self.lock:
            room = qp.max_send_wr - qp.sq_used
            taken = wqes[:max(room, 0)]
            qp.sq.extend(taken)
            qp.sq_used += len(taken)
            self.doorbells[qp.qpn] += 1
            self.lock.notify_all()
            return len(taken)

    def post_recv(self, qp: QPState, wqe: WQE) -> bool:
        with self.lock:
            if qp.rq_used >= qp.max_recv_wr:
                return False
            qp.rq.append(wqe)
            qp.rq_used += 1
            self.lock.notify_all()
            return True

    def poll(self, cq: CQState, n: int) -> list[tuple]:
        with self.lock:
            out = []
            while cq.entries and len(out) < n:
                entry = cq.entries.popleft()
                qp, frees, is_send = entry[-3:]
                if is_send:
                    qp.sq_used -= frees
                else:
                    qp.rq_used -= frees
                out.append(entry[:-3])
            return out

    def close(self) -> None:
        """Stop the NIC thread and drop the host's fake sysfs and GPU memory (a fabric a test made)."""
        with self.lock:
            self._closed = True
            self.lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(INFLIGHT_WAIT)
        self.cuda.release_all()
        shutil.rmtree(self.sysfs, ignore_errors=True)

    # -- the NIC thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                job = self._next_job()
                while job is None:
                    if self._closed:
                        return
                    if not self._changed:  # nothing moved: sleep until posted to, or a retry is due
                        self.lock.wait(0.01 if any(q.sq and q.sq[0].deadline for q in self.qps.values())
                                       else None)
                    job = self._next_job()
            qp, key, dst, pieces, gpu = job
            hook = self.on_packet
            if hook is not None:
                hook(qp.qpn, key)
            for src, n in pieces:
                ctypes.memmove(dst, src, n)
                dst += n
            if gpu is not None:
                self.cuda.placed(gpu)
            with self.lock:
                self.inflight[key] -= 1
                self.lock.notify_all()
                if qp.sq:
                    self._after_packet(qp, qp.sq[0], sum(n for _, n in pieces))

    def _next_job(self) -> tuple | None:
        """Under the lock: the next packet to copy, after doing every step that needs none."""
        self._changed = False
        qps = list(self.qps.values())
        for i in range(len(qps)):
            qp = qps[(self._rr + i) % len(qps)]
            if qp.state == ERR and (qp.sq or qp.rq):
                self._flush(qp)
                continue
            if qp.state != RTS or not qp.sq or qp.qpn in self.paused:
                continue
            job = self._step(qp, qp.sq[0])
            if job is not None:
                self._rr = (self._rr + i + 1) % max(len(qps), 1)
                return job
        return None

    def _step(self, qp: QPState, w: WQE) -> tuple | None:
        """Check `w` at a packet boundary; its next packet, or None (completed, failed or waiting)."""
        if qp.qpn in self.failing:
            return self._fail(qp, w, self.failing.pop(qp.qpn))
        if not w.checked:
            if w.total > self.max_msg_sz:
                return self._fail(qp, w, LOC_LEN_ERR)
            w.host = []
            for addr, n, lkey in w.sges:
                mr = self.mrs.get(lkey)
                if mr is None or mr.pd is not qp.pd or addr < mr.addr or addr + n > mr.addr + mr.length:
                    return self._fail(qp, w, LOC_PROT_ERR)
                w.host.append((addr + mr.shift, n))
        resp = self.qps.get(qp.dest)
        if (resp is None or resp.state not in (RTR, RTS) or frozenset((qp.qpn, qp.dest)) in self.cuts
                or not self.net.delivers(qp.port, qp.ah, resp.port)  # the request gets there
                or not self.net.delivers(resp.port, resp.ah, qp.port)):  # and its ACK back
            return self._retry(qp, w, RETRY_EXC_ERR)
        if w.opcode == OP_WRITE:
            mr = self.mrs.get(w.rkey)
            if (mr is None or mr.pd is not resp.pd or not mr.access & REMOTE_WRITE
                    or not resp.access & REMOTE_WRITE or w.raddr < mr.addr
                    or w.raddr + w.total > mr.addr + mr.length):
                resp.state = ERR
                return self._fail(qp, w, REM_ACCESS_ERR)
            dst_key, dst, gpu = mr.key, w.raddr + w.done + mr.shift, mr.gpu
        else:
            if w.recv is None:
                if not resp.rq:
                    return self._retry(qp, w, RNR_RETRY_EXC_ERR, forever=qp.rnr_retry == 7)
                w.recv = resp.rq.popleft()
                addr, room, lkey = w.recv.sges[0]
                if w.total > room or lkey not in self.mrs:
                    self._complete(resp, w.recv, LOC_LEN_ERR, WC_RECV, 0, send=False)
                    resp.state = ERR
                    return self._fail(qp, w, REM_INV_REQ_ERR)
            mr = self.mrs.get(w.recv.sges[0][2])
            if mr is None:
                return self._fail(qp, w, REM_ACCESS_ERR)
            dst_key, dst, gpu = mr.key, w.recv.sges[0][0] + w.done + mr.shift, mr.gpu
        w.checked, w.deadline = True, None
        if w.total == 0:
            self._after_packet(qp, w, 0)
            return None
        self.inflight[dst_key] += 1
        return qp, dst_key, dst, self._pieces(w, min(self.packet, w.total - w.done)), gpu

    @staticmethod
    def _pieces(w: WQE, n: int) -> list[tuple[int, int]]:
        out, skip = [], w.done
        for addr, length in w.host:
            if skip >= length:
                skip -= length
                continue
            take = min(length - skip, n)
            out.append((addr + skip, take))
            n -= take
            skip = 0
            if n == 0:
                break
        return out

    def _after_packet(self, qp: QPState, w: WQE, n: int) -> None:
        w.done += n
        if w.done < w.total or not qp.sq or qp.sq[0] is not w:
            return
        qp.sq.popleft()
        if w.opcode == OP_SEND:
            resp = self.qps.get(qp.dest)
            if resp is not None:
                self._complete(resp, w.recv, SUCCESS, WC_RECV, w.total, send=False)
        if w.signaled:
            self._complete(qp, w, SUCCESS, WC_SEND if w.opcode == OP_SEND else WC_RDMA_WRITE, w.total)
        else:
            qp.unreported += 1

    def _retry(self, qp: QPState, w: WQE, status: int, forever: bool = False) -> None:
        now = time.monotonic()
        if w.deadline is None:
            w.deadline = now + self.retry_timeout
        if now >= w.deadline and not forever:
            self._fail(qp, w, status)
        return None

    def _fail(self, qp: QPState, w: WQE, status: int) -> None:
        qp.sq.popleft()
        self._complete(qp, w, status, WC_RDMA_WRITE if w.opcode == OP_WRITE else WC_SEND, 0)
        qp.state = ERR
        return None

    def _flush(self, qp: QPState) -> None:
        while qp.sq:
            w = qp.sq.popleft()
            self._complete(qp, w, WR_FLUSH_ERR, WC_SEND, 0)
        while qp.rq:
            self._complete(qp, qp.rq.popleft(), WR_FLUSH_ERR, WC_RECV, 0, send=False)

    def _complete(self, qp: QPState, w: WQE, status: int, opcode: int, nbytes: int,
                  send: bool = True) -> None:
        self._changed = True
        self.lock.notify_all()  # pollers waiting on this CQ (tests) wake
        cq = qp.scq if send else qp.rcq
        frees = 1
        if send:
            frees, qp.unreported = qp.unreported + 1, 0
        if len(cq.entries) >= cq.depth:
            cq.overrun = True  # the CQ overrun: every QP on it goes to ERR
            for other in cq.qps:
                other.state = ERR
            return
        cq.entries.append((w.wr_id, status, opcode, nbytes, qp.qpn, qp, frees, send))
