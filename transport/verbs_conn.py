"""The sending side of one verbs link: an RC QP, the peer's rkeys, windows of linked WRs.

`VerbsConnection` is made by `VerbsEngine.connect`. It creates a CQ and an RC
QP with `qp_access_flags=0` (nothing can write into us through an outbound
link), says `Hello` on the control socket, learns the receiver's QP, regions
and rkeys from `Welcome`, and moves its QP to RTS.

A write is: shared checks (`check_descriptor`, `check_table`, before any WR
exists) -> `verbs_build.plan_wrs` (sorted, coalesced, split at the port's max
message size, dst-contiguous rows gathered into multi-SGE WRs) -> WRITE WRs
-> one SEND carrying the transfer's `Note`. They enter the link's queue in
order; `_pump` posts as many as the SQ has free slots as one linked list —
one doorbell per window — and the progress thread posts the rest as
completions free slots. Every `signal_every`-th WR and every note is
signaled; a completion frees its slot and every earlier one (wr_id is the
WR's position in the link's stream). A note needs a credit (a receive the
peer has posted); each `Acks` entry returns one, so the peer never sees RNR.

The handle completes when the receiver's `Acks` names it — after its note
arrived (RC: after every WRITE before it) and its notify ran. Any error —
an error completion (named by its WC status), a closed control socket, a
protocol violation — severs the link: handles fail, the QP goes to ERR and
is destroyed, and the next `connect()` builds a fresh one.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import socket
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import verbs_build as build
from .base import Connection, LocalRegion, TransferHandle
from .errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from .handles import Handle
from .regions import check_descriptor
from .segments import as_table, check_notify, check_table
from .verbs_wire import CONTROL, SLOT, Acks, Bye, Gone, Hello, Refresh, Regions, Welcome, pack_note
from .wire import ErrorMessage

if TYPE_CHECKING:
    from .verbs import VerbsEngine

log = logging.getLogger(__name__)
BYE_WAIT = 1.0


def region_table(data: bytes) -> dict[int, tuple[int, int, int]]:
    """`{region: (address, length, rkey)}` from a `Welcome`/`Regions` table."""
    if len(data) % 32:
        raise ProtocolError(f"region table of {len(data)} B is not whole (id, addr, len, rkey) rows")
    rows = np.frombuffer(data, dtype="<i8").reshape(-1, 4).tolist()
    return {r: (a, n, k) for r, a, n, k in rows}


def wc_error(api: Any, wc: Any, peer: str) -> TransportError:
    """Our error for a failed work completion, naming its status."""
    S = api.E.ibv_wc_status
    status = int(wc.status)
    what = (f"verbs completion from/to {peer} failed: {api.cqe_status_to_str(status)} "
            f"(status {status}, vendor_err {int(wc.vendor_err):#x})")
    if status in (S.IBV_WC_RETRY_EXC_ERR, S.IBV_WC_RNR_RETRY_EXC_ERR):
        return PeerLostError(f"{what}: the peer is unreachable or dropped us")
    if status == S.IBV_WC_REM_ACCESS_ERR:
        return PeerLostError(f"{what}: the peer revoked access (fenced us or deregistered the region)")
    if status in (S.IBV_WC_REM_INV_REQ_ERR, S.IBV_WC_LOC_LEN_ERR):
        return ProtocolError(f"{what}: a message did not fit; the peers disagree on limits")
    if status == S.IBV_WC_LOC_PROT_ERR:
        return RegistrationError(f"{what}: a local SGE is outside its MR (deregistered mid-transfer?)")
    if status == S.IBV_WC_WR_FLUSH_ERR:
        return PeerLostError(f"{what}: the link had already failed")
    return TransportError(what)


class VerbsConnection(Connection):
    """A link to one peer engine: QP, control socket, the peer's regions, transfers awaiting acks."""

    def __init__(self, engine: VerbsEngine, host: str, port: int, peer: str) -> None:
        self._engine, self.peer, api = engine, peer, engine.api
        self._lock = threading.RLock()  # queue, ids, credits, posting, the QP's lifetime
        self._pending: dict[int, Handle] = {}
        self._queries: dict[int, threading.Event] = {}
        self._error: TransportError | None = None
        self._queue: collections.deque = collections.deque()  # SendWR, or (wr_id, seq, note bytes)
        self._seqs, self._qids = itertools.count(1), itertools.count(1)
        self._next_id = self._completed = self._posted = 0
        self._notes_sent = 0
        self.wrs = self.doorbells = 0  # counters for benchmarks and tests
        depth = engine.sq_depth
        self._cq = api.CQ(engine.ctx, 2 * depth + 8)
        self._qp = api.QP(engine.pd, build.qp_init_attr(api, self._cq, depth, 1, engine.max_sge))
        self._mr = None
        try:
            sock = socket.create_connection((host, port), timeout=engine.connect_timeout)
        except OSError as exc:
            self._destroy()
            raise PeerLostError(f"cannot connect to verbs engine {peer} at {host}:{port}: {exc}") from exc
        self._sock = sock
        try:
            welcome = self._handshake(host, port)
            self._credits = welcome.credits
            self._note_buf = np.zeros(welcome.credits * SLOT, np.uint8)
            self._note_base = int(self._note_buf.ctypes.data)
            self._mr = api.MR(engine.pd, self._note_buf.nbytes, int(api.E.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE),
                              address=self._note_base)
        except BaseException:
            sock.close()
            self._destroy()
            raise
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name=f"verbs-out {peer}", daemon=True)
        self._reader.start()

    def _handshake(self, host: str, port: int) -> Welcome:
        e, api = self._engine, self._engine.api
        psn = random.getrandbits(24)
        p = e.port
        CONTROL.send(self._sock, Hello(e.engine_id, self._qp.qp_num, psn, p.lid, p.gid, p.mtu))
        welcome = CONTROL.recv(self._sock)
        if isinstance(welcome, ErrorMessage):
            raise ProtocolError(f"verbs engine {self.peer} refused the link: {welcome.reason}")
        if not isinstance(welcome, Welcome):
            raise ProtocolError(f"expected welcome from {self.peer}, got {type(welcome).TYPE}")
        if welcome.engine != self.peer:
            raise RegistrationError(
                f"{host}:{port} is verbs engine {welcome.engine}, not {self.peer}; the address is stale"
            )
        if not 0 < welcome.credits <= 4096:
            raise ProtocolError(f"welcome offers {welcome.credits} credits; expected 1..4096")
        self._regions = region_table(welcome.regions)
        attr = build.connect_attr(api, port_num=p.port_num, mtu=min(p.mtu, welcome.mtu), access=0,
                                  dest_qpn=welcome.qpn, rq_psn=welcome.psn, sq_psn=psn,
                                  lid=welcome.lid, gid=welcome.gid, sgid_index=p.gid_index,
                                  ethernet=p.ethernet)
        try:
            self._qp.to_rts(attr)
        except api.PyverbsError as exc:
            raise PeerLostError(f"cannot connect the QP to {self.peer}: {exc}") from exc
        return welcome

    @property
    def alive(self) -> bool:
        return self._error is None

    @property
    def dead(self) -> bool:
        return self._error is not None

    # -- writes ---------------------------------------------------------------
    def write(self, local: LocalRegion, remote: dict[str, Any], segments: np.ndarray,
              notify: bytes | None = None) -> TransferHandle:
        if self._error is not None:
            raise self._error
        e = self._engine
        src = e.regions.local(local)
        lkey, src_base = e._local_key(src)
        region_id, length = check_descriptor(remote, e.name, self.peer)
        base, dst_length, rkey = self._resolve(region_id)
        if dst_length != length:
            raise RegistrationError(
                f"descriptor says region {region_id} has {length} B but it has {dst_length} B; "
                "the descriptor is stale or was edited"
            )
        table = as_table(segments)
        nbytes = check_table(table, src.length, dst_length)
        payload = check_notify(notify)
        rows, starts = build.plan_wrs(table, e.max_sge, e.max_msg)
        with self._lock:
            if self._error is not None:
                raise self._error
            seq = next(self._seqs)
            handle = Handle(nbytes, f"verbs transfer {seq} to {self.peer}")
            wrs = build.write_wrs(e.api, rows, starts, src_base=src_base, lkey=lkey, dst_base=base,
                                  rkey=rkey, first_id=self._next_id, signal_every=e.signal_every)
            self._next_id += len(wrs) + 1
            self._pending[seq] = handle  # before posting: the ack may beat us back
            self._queue.extend(wrs)
            self._queue.append((self._next_id - 1, seq, pack_note(seq, payload)))
            self._pump()
        e._kick()
        return handle

    def _pump(self) -> None:
        """Post one window: as many queued WRs as the SQ has slots, linked, one doorbell."""
        e, api = self._engine, self._engine.api
        free = e.sq_depth - (self._posted - self._completed)
        window: list = []
        while self._queue and len(window) < free:
            item = self._queue[0]
            if isinstance(item, tuple):
                if self._credits == 0:
                    break
                self._credits -= 1
                wr_id, _, note = item
                slot = self._notes_sent % (self._note_buf.nbytes // SLOT)
                self._notes_sent += 1
                self._note_buf[slot * SLOT: slot * SLOT + len(note)] = np.frombuffer(note, np.uint8)
                item = build.note_wr(api, wr_id, self._note_base + slot * SLOT, len(note), self._mr.lkey)
            self._queue.popleft()
            window.append(item)
        if not window:
            return
        try:  # post_send copies the WRs into WQEs: `window` need only outlive the call
            self._qp.post_send(build.link(window))
        except api.PyverbsError as exc:
            self.sever(PeerLostError(f"posting {len(window)} WRs to {self.peer} failed: {exc}"))
            return
        self._posted += len(window)
        self.wrs += len(window)
        self.doorbells += 1

    # -- progress (called by the engine's progress thread) -----------------------
    def poll(self) -> bool:
        """Reap send completions and post what they freed room for; True if any arrived."""
        with self._lock:
            if self._error is not None:
                return False
            n, wcs = self._cq.poll(64)
            for wc in wcs:
                if wc.status != self._engine.api.E.ibv_wc_status.IBV_WC_SUCCESS:
                    self.sever(wc_error(self._engine.api, wc, self.peer))
                    return True
                self._completed = max(self._completed, int(wc.wr_id) + 1)
            if n:
                self._pump()
            return bool(n)

    def _resolve(self, region_id: int) -> tuple[int, int, int]:
        found = self._regions.get(region_id)
        if found is None:
            self._refresh()
            found = self._regions.get(region_id)
        if found is None:
            raise RegistrationError(
                f"engine {self.peer} has no region {region_id} (never registered or deregistered); "
                "ask the peer for a fresh descriptor"
            )
        return found

    def _refresh(self) -> None:
        query, done = next(self._qids), threading.Event()
        with self._lock:
            if self._error is not None:
                raise self._error
            self._queries[query] = done
        try:
            CONTROL.send(self._sock, Refresh(query))
            if not done.wait(self._engine.connect_timeout):
                raise TransferTimeout(
                    f"verbs engine {self.peer} did not answer a region refresh in "
                    f"{self._engine.connect_timeout} s; it is stalled — drop it or retry"
                )
        finally:
            with self._lock:
                self._queries.pop(query, None)
        if self._error is not None:
            raise self._error

    # -- the control reader ---------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = CONTROL.recv(self._sock)
                if isinstance(msg, Acks):
                    self._acked(msg.seqs)
                elif isinstance(msg, Regions):
                    self._regions = region_table(msg.regions)
                    with self._lock:
                        done = self._queries.get(msg.query)
                    if done is not None:
                        done.set()
                elif isinstance(msg, Gone):
                    self._regions = {k: v for k, v in self._regions.items() if k != msg.region}
                elif isinstance(msg, ErrorMessage):
                    raise ProtocolError(f"verbs engine {self.peer} hung up: {msg.reason}")
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from verbs engine {self.peer}")
        except PeerLostError as exc:
            self.sever(PeerLostError(
                f"verbs engine {self.peer} closed the link (it died, closed, or dropped us): {exc}"
            ))
        except TransportError as exc:
            self.sever(exc)

    def _acked(self, data: bytes) -> None:
        if len(data) % 8:
            raise ProtocolError(f"acks of {len(data)} B are not whole int64s")
        seqs = np.frombuffer(data, dtype="<i8").tolist()
        with self._lock:
            handles = [self._pending.pop(s, None) for s in seqs]
            self._credits += len(seqs)
            self._pump()
        for handle in handles:
            if handle is not None:
                handle.complete()

    # -- teardown -------------------------------------------------------------
    def sever(self, error: TransportError) -> None:
        """Kill the link with `error`: pending transfers fail, the QP is destroyed. Idempotent."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending, self._pending = list(self._pending.values()), {}
            queries = list(self._queries.values())
            self._queue.clear()
        for handle in pending:
            handle.fail(error)
        for done in queries:
            done.set()
        if not isinstance(error, ClosedError):
            self._hang_up()

    def _destroy(self) -> None:
        """QP to ERR, then destroy QP, note MR and CQ (under the lock: no poll is running)."""
        api = self._engine.api
        with self._lock:
            qp, self._qp = getattr(self, "_qp", None), None
            if qp is not None:
                try:
                    qp.modify(*build.err_attr(api))
                except api.PyverbsError:
                    pass
                qp.close()
            mr, self._mr = self._mr, None
            if mr is not None:
                mr.close()
            cq, self._cq = getattr(self, "_cq", None), None
            if cq is not None:
                cq.close()

    def _hang_up(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._destroy()
        self._engine._disconnect(self)

    def close(self) -> None:
        """Fail what is in flight with `ClosedError`; the peer fences the link before we let go."""
        if self._error is not None and not isinstance(self._error, ClosedError):
            return
        first = self._error is None
        self.sever(ClosedError(f"verbs connection {self._engine.engine_id}->{self.peer} closed"))
        if not first:
            return
        try:  # the peer fences us on Bye and hangs up; its hang-up ends our reader
            CONTROL.send(self._sock, Bye())
        except TransportError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(BYE_WAIT)
        self._hang_up()
