"""The receiving side of one verbs link: its QP, receive slots, per-link MRs, and the fence.

Each inbound link gets its own RC QPs (one per rail of the sender) with
`REMOTE_WRITE`, one CQ, `credits` receive slots per rail for notes, and its own MR over every registered region
(`LOCAL_WRITE|REMOTE_WRITE`), whose rkeys go to that sender alone in
`Welcome`/`Regions`. Per-link MRs are what make `drop_peer` a real fence:

`fence()` = QPs -> ERR (stop taking packets, flush), then close every MR of
this link, then destroy the QPs. Only MR deregistration carries a written
"no DMA after return" guarantee (the mlx5 revoke contract): a QP moved to
ERR still lets a packet already being placed finish after `modify` returned.
The software fabric models exactly that, and tests/transport/
test_verbs_fabric.py shows a fence of ERR alone letting bytes in.

Notes: a note arrives as a receive completion on this link's CQ — on RC,
after every WRITE posted before it on the same QP is placed. The progress
thread takes its bytes out of the slot, reposts the slot, delivers notify
(without holding this link's lock: a handler may call `drop_peer`), then
acks; an ack returns the sender's credit.
"""

from __future__ import annotations

import logging
import random
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import verbs_build as build
from . import verbs_wire
from .control_link import ControlPeer
from .errors import PeerLostError, ProtocolError, TransportError
from .regions import Region
from .verbs_api import wc_error
from .verbs_mem import access_flags, register_mr
from .verbs_wire import CONTROL, SLOT, Bye, Gone, Hello, Refresh, Regions, unpack_note

if TYPE_CHECKING:
    from .verbs import VerbsEngine

log = logging.getLogger(__name__)
SEND_TIMEOUT = 5.0  # a sender that stops reading must not stall our progress thread in an ack


class InboundPeer(ControlPeer):
    """One sender's link into this engine: its QP, slots, MRs, control socket and fence."""

    WIRE = verbs_wire

    def __init__(self, engine: VerbsEngine, sock: socket.socket, where: str) -> None:
        self.engine, self.sock, self.where = engine, sock, where
        self.sender: str | None = None
        self.lock = threading.Lock()  # every verbs call on this link's QP/CQ/MRs
        self.send_lock = threading.Lock()
        self.dead = False
        self.qps: list = []  # one RC QP per rail of the sender
        self.cq: Any = None
        self._partial: dict[int, list] = {}  # seq -> [notes arrived, payload] of striped transfers
        self._slots_mr: Any = None
        self._mrs: dict[int, tuple[Any, int]] = {}  # region id -> (MR, base)
        self._thread = threading.Thread(target=self._serve, name=f"verbs-in {where}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the peer's thread is running, or about to (not yet started)."""
        return self._thread.ident is None or self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the peer's thread: close() joins what the engine started."""
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join(timeout)

    # -- setup --------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self.sock.settimeout(self.engine.connect_timeout)
            hello = CONTROL.recv(self.sock)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {type(hello).TYPE}")
            self.sender = hello.engine
            welcome = self.engine._admit(self, hello)  # builds the QP and MRs under the engine lock
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                 struct.pack("ll", int(SEND_TIMEOUT), 0))
            self._send(welcome)
            while not self.dead:
                msg = CONTROL.recv(self.sock)
                if isinstance(msg, Refresh):
                    self._send(Regions(msg.query, self.region_rows()))
                elif isinstance(msg, Bye):
                    break
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from sender {self.sender}")
        except (TransportError, OSError) as exc:
            if not self.dead and not isinstance(exc, PeerLostError):
                log.warning("verbs link from %s (%s) dropped: %s", self.sender, self.where, exc)
        except Exception:
            log.exception("verbs link from %s (%s) failed", self.sender, self.where)
        self.fence()

    def build(self, hello: Hello, regions: list[Region]) -> tuple[list[int], list[int]]:
        """Create QPs, slots and MRs and bring the QPs to RTR: `(qpns, psns)` for the welcome."""
        e, api = self.engine, self.engine.api
        rails = len(hello.qpns)
        ints = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24
                   for v in hello.qpns + hello.psns)
        if not 0 < rails <= e.MAX_RAILS or len(hello.psns) != rails or not ints:
            raise ProtocolError(f"hello names {rails} QPs / {len(hello.psns)} PSNs; expected "
                                f"1..{e.MAX_RAILS} of each, 24-bit ints")
        credits = e.credits
        self.cq = api.CQ(e.ctx, rails * credits + 8)
        self.qps = [api.QP(e.pd, build.qp_init_attr(api, self.cq, 1, credits, 1)) for _ in range(rails)]
        self._slots = np.zeros(rails * credits * SLOT, np.uint8)
        self._slots_base = int(self._slots.ctypes.data)
        self._slots_mr = api.MR(e.pd, self._slots.nbytes, access_flags(api, False), address=self._slots_base)
        for region in regions:
            self.add_region(region)
        p, psns = e.port, []
        for r, qp in enumerate(self.qps):
            psns.append(random.getrandbits(24))
            attr = build.connect_attr(api, port_num=p.port_num, mtu=min(p.mtu, hello.mtu),
                                      access=access_flags(api, True), dest_qpn=hello.qpns[r],
                                      rq_psn=hello.psns[r], sq_psn=psns[-1], lid=hello.lid,
                                      gid=hello.gid, sgid_index=p.gid_index, ethernet=p.ethernet)
            qp.to_init(attr)
            for slot in range(r * credits, (r + 1) * credits):  # before RTR: a note may follow at once
                self._repost(slot)
            qp.to_rtr(attr)
        return [qp.qp_num for qp in self.qps], psns

    def _repost(self, slot: int) -> None:
        """Post receive slot `slot` (rail `slot // credits`) again."""
        api = self.engine.api
        self.qps[slot // self.engine.credits].post_recv(
            build.recv_wr(api, slot, self._slots_base + slot * SLOT, SLOT, self._slots_mr.lkey))

    def region_rows(self) -> bytes:
        """`(region, address, length, rkey)` rows of this link's MRs, as int64 bytes."""
        with self.lock:
            rows = [[rid, base, mr.length, mr.rkey] for rid, (mr, base) in self._mrs.items()]
        return np.array(rows, dtype="<i8").reshape(-1, 4).tobytes()

    # -- regions ------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        """Register `region` for this sender alone (its own rkey)."""
        e = self.engine
        with self.lock:
            if self.dead or region.region_id in self._mrs:
                return
            if e.fence == "qp":  # the engine's own MR, shared by every link: never ours to close
                self._mrs[region.region_id] = e._local[region.region_id]
                return
            self._mrs[region.region_id] = register_mr(e.api, e.pd, region, access_flags(e.api, True),
                                                      e._dmabufs)

    def drop_region(self, region_id: int, *, tell: bool = True) -> None:
        """Deregister this link's MR of a region (waits out packets into it) and say `Gone`."""
        with self.lock:
            found = self._mrs.pop(region_id, None)
            if found is not None and self.engine.fence == "mr":
                found[0].close()
        if found is not None and tell:
            self.send(Gone(region_id))

    # -- data path (called by the progress thread) ---------------------------
    def poll(self) -> list[tuple[int, bytes | None]] | None:
        """`(seq, payload)` of the notes that arrived; None once the link is dead."""
        api = self.engine.api
        out, broken = [], None
        with self.lock:
            if self.dead:
                return None
            _, wcs = self.cq.poll(self.engine.credits * len(self.qps))
            for wc in wcs:
                if wc.status != api.E.ibv_wc_status.IBV_WC_SUCCESS:
                    broken = wc_error(api, wc, self.sender or "?")
                    break
                slot = int(wc.wr_id)
                data = self._slots[slot * SLOT: slot * SLOT + int(wc.byte_len)].tobytes()
                self._repost(slot)
                try:
                    done = self._collect(unpack_note(data))
                except ProtocolError as exc:
                    broken = exc
                    break
                if done is not None:
                    out.append(done)
        if broken is not None:
            log.warning("verbs link from %s broke: %s", self.sender, broken)
            self.fence()
        return out

    def _collect(self, note: Any) -> tuple[int, bytes | None] | None:
        """`(seq, payload)` once every rail's note of a transfer is in, else None (bounded)."""
        if not 0 <= note.rail < note.rails <= len(self.qps):
            raise ProtocolError(f"note for rail {note.rail} of {note.rails} on a {len(self.qps)}-rail link")
        if note.rails == 1:
            return note.seq, note.payload
        got = self._partial.setdefault(note.seq, [0, None])
        got[0] += 1
        if note.payload is not None:
            got[1] = note.payload
        if got[0] < note.rails:
            if len(self._partial) > len(self.qps) * self.engine.credits:
                raise ProtocolError(f"{len(self._partial)} striped transfers half-arrived: more than credits")
            return None
        del self._partial[note.seq]
        return note.seq, got[1]

    # -- the fence ----------------------------------------------------------
    def _revoke(self) -> None:
        """Close every MR of this link: returns when no packet can land through them.

        Under fence="qp" the MRs are the engine's, shared: nothing is closed, and a
        packet already in flight may land after the fence (the documented weaker mode).
        """
        if self.engine.fence == "mr":
            for mr, _ in self._mrs.values():
                mr.close()
        self._mrs.clear()

    def fence(self) -> None:
        """After return, none of this sender's bytes lands in our memory. Idempotent."""
        api = self.engine.api
        with self.lock:
            if self.dead:
                return
            self.dead = True
            for qp in self.qps:
                try:
                    qp.modify(*build.err_attr(api))
                except api.PyverbsError as exc:
                    log.warning("verbs: moving a QP of %s to ERR failed: %s", self.sender, exc)
            self._revoke()
            for obj in (*self.qps, self._slots_mr, self.cq):
                if obj is not None:
                    obj.close()
            self.qps, self.cq, self._slots_mr = [], None, None
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.engine._forget(self)
