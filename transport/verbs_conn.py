"""The sending side of one verbs link: an RC QP, the peer's rkeys, windows of linked WRs.

`VerbsConnection` is made by `VerbsEngine.connect`. It creates one CQ and
`rails` RC QPs with `qp_access_flags=0` (nothing can write into us through an
outbound link), says `Hello` on the control socket, learns the receiver's
QPs, regions and rkeys from `Welcome`, and moves its QPs to RTS.

A write is: shared checks (`check_descriptor`, `check_table`, before any WR
exists) -> `verbs_build.plan_wrs` (sorted, coalesced, split at the port's max
message size, dst-contiguous rows gathered into multi-SGE WRs) -> WRITE WRs
-> one SEND carrying the transfer's `Note`. A transfer of at least
`RAIL_MIN` bytes per rail is first cut into byte-balanced stripes, one per
rail, each ending with its own note. They enter the rail's queue in order;
`_pump` posts as many as the SQ has free slots as one linked list —
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
from . import verbs_wire
from .base import Connection, LocalRegion, TransferHandle
from .control_link import ControlLink
from .errors import PeerLostError, ProtocolError, RegistrationError, TransportError
from .handles import Handle
from .regions import check_descriptor
from .segments import as_table, balanced_parts, check_notify, check_table
from .streams import capture, host_wait
from .verbs_api import wc_error
from .verbs_wire import CONTROL, SLOT, Acks, Hello, Regions, Welcome, pack_note
from .wire import ErrorMessage

if TYPE_CHECKING:
    from .verbs import VerbsEngine

log = logging.getLogger(__name__)
RAIL_MIN = 1 << 20  # a transfer is striped over one rail per this many bytes, up to `rails`


class _Rail:
    """One QP of a link and its share of the stream: queue, WR ids, SQ slots, note credits."""

    __slots__ = ("completed", "credits", "index", "next_id", "notes", "posted", "psn", "qp", "queue")

    def __init__(self, index: int, qp: Any) -> None:
        self.index, self.qp, self.psn = index, qp, random.getrandbits(24)
        self.queue: collections.deque = collections.deque()  # SendWR, or (wr_id, note bytes)
        self.next_id = self.completed = self.posted = self.notes = self.credits = 0


def region_table(data: bytes) -> dict[int, tuple[int, int, int]]:
    """`{region: (address, length, rkey)}` from a `Welcome`/`Regions` table."""
    if len(data) % 32:
        raise ProtocolError(f"region table of {len(data)} B is not whole (id, addr, len, rkey) rows")
    rows = np.frombuffer(data, dtype="<i8").reshape(-1, 4).tolist()
    return {r: (a, n, k) for r, a, n, k in rows}


class VerbsConnection(ControlLink, Connection):
    """A link to one peer engine: QPs, control socket, the peer's regions, transfers awaiting acks."""

    WIRE = verbs_wire

    def __init__(self, engine: VerbsEngine, host: str, port: int, peer: str) -> None:
        self._engine, self.peer, api = engine, peer, engine.api
        self._lock = threading.RLock()  # queue, ids, credits, posting, the QP's lifetime
        self._pending: dict[int, tuple[Handle, int]] = {}  # seq -> (handle, rails it used)
        self._queries: dict[int, threading.Event] = {}
        self._error: TransportError | None = None
        self._seqs, self._qids = itertools.count(1), itertools.count(1)
        self.wrs = self.doorbells = 0  # counters for benchmarks and tests
        depth = engine.sq_depth
        # One send CQ for every rail: at most 2 CQEs per SQ slot (signaled + flushed) each.
        self._cq = api.CQ(engine.ctx, engine.rails * (2 * depth + 8))
        self._rails = [_Rail(i, api.QP(engine.pd, build.qp_init_attr(api, self._cq, depth, 1, engine.max_sge)))
                       for i in range(engine.rails)]
        self._by_qpn = {r.qp.qp_num: r for r in self._rails}
        self._mr = None
        try:
            sock = socket.create_connection((host, port), timeout=engine.connect_timeout)
        except OSError as exc:
            self._release()
            raise PeerLostError(f"cannot connect to verbs engine {peer} at {host}:{port}: {exc}") from exc
        self._sock = sock
        try:
            welcome = self._handshake(host, port)
            self._credits = welcome.credits
            for rail in self._rails:
                rail.credits = welcome.credits
            self._note_buf = np.zeros(len(self._rails) * welcome.credits * SLOT, np.uint8)
            self._note_base = int(self._note_buf.ctypes.data)
            self._mr = api.MR(engine.pd, self._note_buf.nbytes, int(api.E.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE),
                              address=self._note_base)
        except BaseException:
            sock.close()
            self._release()
            raise
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name=f"verbs-out {peer}", daemon=True)
        self._reader.start()

    def _handshake(self, host: str, port: int) -> Welcome:
        e, api = self._engine, self._engine.api
        p = e.port
        CONTROL.send(self._sock, Hello(e.engine_id, [r.qp.qp_num for r in self._rails],
                                       [r.psn for r in self._rails], p.lid, p.gid, p.mtu))
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
        if (len(welcome.qpns) != len(self._rails) or len(welcome.psns) != len(self._rails)
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24
                           for v in welcome.qpns + welcome.psns)):
            raise ProtocolError(f"welcome names QPs {welcome.qpns!r} / PSNs {welcome.psns!r} for our "
                                f"{len(self._rails)} rails; expected that many 24-bit ints of each")
        self._regions = region_table(welcome.regions)
        for rail, qpn, psn in zip(self._rails, welcome.qpns, welcome.psns, strict=True):
            attr = build.connect_attr(api, port_num=p.port_num, mtu=min(p.mtu, welcome.mtu), access=0,
                                      dest_qpn=qpn, rq_psn=psn, sq_psn=rail.psn, lid=welcome.lid,
                                      gid=welcome.gid, sgid_index=p.gid_index, ethernet=p.ethernet)
            try:
                rail.qp.to_rts(attr)
            except api.PyverbsError as exc:
                raise PeerLostError(f"cannot connect a QP to {self.peer}: {exc}") from exc
        return welcome

    # -- writes ---------------------------------------------------------------
    def write(self, local: LocalRegion, remote: dict[str, Any], segments: np.ndarray,
              notify: bytes | None = None, *, ready: Any = None) -> TransferHandle:
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
        # The NIC reads the source itself: the host waits for the producer's event (only it).
        host_wait(capture(ready, src.data.device), e.connect_timeout, f"a write to {self.peer}")
        # Striped over rails by bytes: each rail's note lands after that rail's WRITEs, and the
        # receiver delivers notify once every rail's note is in. Small transfers use one rail.
        stripes = min(len(self._rails), max(1, -(-nbytes // RAIL_MIN)))
        parts = balanced_parts(table, stripes) if stripes > 1 else [table]
        plans = [build.plan_wrs(part, e.max_sge, e.max_msg) for part in parts]
        with self._lock:
            if self._error is not None:
                raise self._error
            seq = next(self._seqs)
            handle = Handle(nbytes, f"verbs transfer {seq} to {self.peer}")
            self._pending[seq] = (handle, len(plans))  # before posting: the ack may beat us back
            for rail, (rows, starts) in zip(self._rails, plans, strict=False):
                wrs = build.write_wrs(e.api, rows, starts, src_base=src_base, lkey=lkey,
                                      dst_base=base, rkey=rkey, first_id=rail.next_id,
                                      signal_every=e.signal_every)
                rail.next_id += len(wrs) + 1
                rail.queue.extend(wrs)
                last = rail.index == len(plans) - 1
                rail.queue.append((rail.next_id - 1, pack_note(seq, rail.index, len(plans),
                                                               payload if last else None)))
                self._pump(rail)
        e._kick()
        return handle

    def _pump(self, rail: _Rail) -> None:
        """Post one window on `rail`: as many queued WRs as its SQ has slots, linked, one doorbell."""
        e, api = self._engine, self._engine.api
        free = e.sq_depth - (rail.posted - rail.completed)
        window: list = []
        while rail.queue and len(window) < free:
            item = rail.queue[0]
            if isinstance(item, tuple):
                if rail.credits == 0:
                    break
                rail.credits -= 1
                wr_id, note = item
                slot = rail.index * self._credits + rail.notes % self._credits
                rail.notes += 1
                self._note_buf[slot * SLOT: slot * SLOT + len(note)] = np.frombuffer(note, np.uint8)
                item = build.note_wr(api, wr_id, self._note_base + slot * SLOT, len(note), self._mr.lkey)
            rail.queue.popleft()
            window.append(item)
        if not window:
            return
        try:  # post_send copies the WRs into WQEs: `window` need only outlive the call
            rail.qp.post_send(build.link(window))
        except api.PyverbsError as exc:
            self.sever(PeerLostError(f"posting {len(window)} WRs to {self.peer} failed: {exc}"))
            return
        rail.posted += len(window)
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
                rail = self._by_qpn[wc.qp_num]
                rail.completed = max(rail.completed, int(wc.wr_id) + 1)
            if n:
                for rail in self._rails:
                    self._pump(rail)
            return bool(n)

    # -- the control link's hooks (control_link.ControlLink) ---------------------
    def _on_regions(self, msg: Regions) -> None:
        self._regions = region_table(msg.regions)

    def _on_acks(self, msg: Acks) -> None:
        if len(msg.seqs) % 8:
            raise ProtocolError(f"acks of {len(msg.seqs)} B are not whole int64s")
        seqs = np.frombuffer(msg.seqs, dtype="<i8").tolist()
        with self._lock:
            done = [self._pending.pop(s, None) for s in seqs]
            for found in done:
                for rail in self._rails[:found[1] if found else 0]:
                    rail.credits += 1  # the peer reposted that rail's slot before acking
            for rail in self._rails:
                self._pump(rail)
        for found in done:
            if found is not None:
                found[0].complete()

    def _drop_pending(self, pending: list) -> list:
        for rail in self._rails:
            rail.queue.clear()
        return [handle for handle, _ in pending]

    def _release(self) -> None:
        """QPs to ERR, then destroy QPs, note MR and CQ (under the lock: no poll is running)."""
        api = self._engine.api
        with self._lock:
            rails, self._rails = getattr(self, "_rails", []), []
            for rail in rails:
                try:
                    rail.qp.modify(*build.err_attr(api))
                except api.PyverbsError:
                    pass
                rail.qp.close()
            mr, self._mr = self._mr, None
            if mr is not None:
                mr.close()
            cq, self._cq = getattr(self, "_cq", None), None
            if cq is not None:
                cq.close()
