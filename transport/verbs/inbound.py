"""The receiving side of one verbs link: its QPs, receive slots, per-link MRs, and the fence.

Each inbound link (a kit `ControlInbound`, served on the engine's one
hardened listener) gets its own RC QPs (one per rail of the sender) with
`REMOTE_WRITE`, one CQ, `credits` receive slots per rail for notes, and —
under `fence="mr"` — its own MR over every registered region
(`LOCAL_WRITE|REMOTE_WRITE`, a child of the region keyed by this link),
whose rkeys go to that sender alone in `Welcome`/`Regions`. Per-link MRs are
what make `drop_peer` a real fence:

`stop_path()` = QPs -> ERR (stop taking packets, flush), then close every MR
of this link, then destroy the QPs. Only MR deregistration carries a
written "no DMA after return" guarantee (the mlx5 revoke contract): a QP
moved to ERR still lets a packet already being placed finish after
`modify` returned. The software fabric models exactly that, and
tests/transport/test_verbs_backend.py shows a fence of ERR alone letting
bytes in. Under `fence="qp"` the MRs are the engine's, shared by every
link: nothing is revoked, a packet in flight may land after the QPs went to
ERR — so that engine declares `capabilities.fence=False` and the kit's
`drop_peer` refuses rather than pretend.

Notes: a note arrives as a receive completion on this link's CQ — on RC,
after every WRITE posted before it on the same QP is placed. The progress
thread takes its bytes out of the slot, reposts the slot, delivers notify
through the kit (`InboundLink.deliver`: never after a fence; a handler may
call `drop_peer`), then acks; an ack returns the sender's credit.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pdxfer.transport.verbs.build as build  # absolute: `from . import` depends on verbs/__init__
import pdxfer.transport.verbs.wire as verbs_wire

from .. import closing
from ..control import ControlInbound
from ..errors import ClosedError, CloseError, PeerLostError, ProtocolError, TransportError
from ..inbound import InboundTable
from ..listener import Slot
from ..regions import Region
from .api import wc_error
from .device import MAX_RAILS, Device
from .mem import access_flags, register_mr
from .wire import SLOT, Hello, Regions, Welcome, unpack_note

log = logging.getLogger(__name__)


class _LinkMR:
    """A region's MR for one link (fence="mr"): a child of the region, keyed by the link."""

    def __init__(self, peer: InboundPeer, region_id: int) -> None:
        self._peer, self._region_id = peer, region_id

    def close(self) -> None:
        self._peer.drop_mr(self._region_id)


class InboundPeer(ControlInbound):
    """One sender's link into this engine: its QPs, slots, MRs, control socket and fence."""

    WIRE = verbs_wire

    def __init__(self, table: InboundTable, sock: socket.socket, where: str, slot: Slot, *,
                 engine_id: str, serial: int, dev: Device,
                 admit: Callable[[InboundPeer], list[Region]]) -> None:
        super().__init__(table, sock, f"verbs link from {where}", slot)
        self._engine_id, self.serial, self._dev = engine_id, serial, dev
        self._admit = admit  # adds every live region (see add_region for the race with register())
        self.lock = threading.Lock()  # every verbs call on this link's QP/CQ/MRs
        self.qps: list = []  # one RC QP per rail of the sender
        self.cq: Any = None
        self._slots_mr: Any = None
        self._partial: dict[int, list] = {}  # seq -> [notes arrived, payload] of striped transfers
        self._mrs: dict[int, tuple[Any, int, bool]] = {}  # region id -> (MR, base, ours to close)
        self._regions: dict[int, Region] = {}  # the regions we hold a child of
        self._adding: set[int] = set()  # regions whose MR is being registered (no lock held)

    # -- setup (the control thread) ---------------------------------------------------
    def admit(self, hello: Hello) -> Welcome:
        self.identify(hello.engine, f"{hello.engine}#{self.serial}")
        dev, api = self._dev, self._dev.api
        try:
            qpns, psns = self._build(hello)
        except api.PyverbsError as exc:
            raise TransportError(f"cannot build the link from {hello.engine}: {exc}") from exc
        p = dev.port
        return Welcome(self._engine_id, qpns, psns, p.lid, p.gid, p.mtu, self.region_rows(), dev.credits,
                       self.incarnation)

    def _build(self, hello: Hello) -> tuple[list[int], list[int]]:
        """Create QPs, slots and MRs and bring the QPs to RTR: `(qpns, psns)` for the welcome."""
        dev, api = self._dev, self._dev.api
        rails = len(hello.qpns)
        ints = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24
                   for v in hello.qpns + hello.psns)
        if not 0 < rails <= MAX_RAILS or len(hello.psns) != rails or not ints:
            raise ProtocolError(f"hello names {rails} QPs / {len(hello.psns)} PSNs; expected "
                                f"1..{MAX_RAILS} of each, 24-bit ints")
        credits = dev.credits
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            self.cq = api.CQ(dev.ctx, rails * credits + 8)
            self.qps = [api.QP(dev.pd, build.qp_init_attr(api, self.cq, 1, credits, 1))
                        for _ in range(rails)]
            self._slots = np.zeros(rails * credits * SLOT, np.uint8)
            self._slots_base = int(self._slots.ctypes.data)
            self._slots_mr = api.MR(dev.pd, self._slots.nbytes, access_flags(api, False),
                                    address=self._slots_base)
        self._admit(self)  # every live region's MR (no lock held: pinning may take seconds)
        p, psns, path = dev.port, [], dev.path(hello.lid, hello.gid)
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            for r, qp in enumerate(self.qps):
                psns.append(random.getrandbits(24))
                attr = build.connect_attr(api, mtu=min(p.mtu, hello.mtu), access=access_flags(api, True),
                                          dest_qpn=hello.qpns[r], rq_psn=hello.psns[r], sq_psn=psns[-1],
                                          **path)
                qp.to_init(attr)
                for slot in range(r * credits, (r + 1) * credits):  # before RTR: a note may follow at once
                    self._repost(slot)
                qp.to_rtr(attr)
            return [qp.qp_num for qp in self.qps], psns

    def _repost(self, slot: int) -> None:
        """Post receive slot `slot` (rail `slot // credits`) again (lock held)."""
        api = self._dev.api
        self.qps[slot // self._dev.credits].post_recv(
            build.recv_wr(api, slot, self._slots_base + slot * SLOT, SLOT, self._slots_mr.lkey))

    def region_rows(self) -> bytes:
        """`(region, address, length, rkey)` rows of this link's MRs, as int64 bytes."""
        with self.lock:
            rows = [[rid, base, mr.length, mr.rkey] for rid, (mr, base, _) in self._mrs.items()]
        return np.array(rows, dtype="<i8").reshape(-1, 4).tobytes()

    def regions_reply(self, query: int) -> Regions:
        return Regions(query, self.region_rows())

    # -- regions ----------------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        """Give this sender the region: its own MR (fence="mr"), or the engine's shared one ("qp").

        The registration — pinning, seconds for tens of GiB — runs with no
        lock held: the progress thread keeps polling this link and every
        other one meanwhile. `register()` (for every link) and this link's
        admission (for every region) may both reach one pair; the first
        registers, the second skips it. Nothing is lost: a link still being
        admitted has not sent its `Welcome`, and `register()` returns (and a
        sender can name the region) only after its own call finished, so a
        `Refresh` then finds the MR.
        """
        dev, rid = self._dev, region.region_id
        with self.lock:
            if self.dead or rid in self._mrs or rid in self._adding:
                return
            if dev.fence == "qp":  # the engine's own MR, shared by every link: never ours to close
                shared = region.child("mr")
                self._mrs[rid] = (shared.mr, shared.base, False)
                return
            self._adding.add(rid)
        try:
            mr, base = register_mr(dev.api, dev.pd, region, access_flags(dev.api, True))
        except BaseException:
            with self.lock:
                self._adding.discard(rid)
            raise
        with self.lock:
            self._adding.discard(rid)
            fenced = self.dead
            if not fenced:
                self._mrs[rid] = (mr, base, True)
                self._regions[rid] = region
        if fenced:  # the link was fenced meanwhile: this rkey was never announced
            mr.close()
            return
        key = ("verbs-link", self.serial)
        try:
            region.adopt(key, _LinkMR(self, rid))
        except ClosedError:  # deregistered meanwhile: adopt closed the MR (drop_mr)
            return
        if self.dead:  # fenced meanwhile: stop_path closed the MR; let the region go
            region.drop(key)

    def drop_mr(self, region_id: int) -> None:
        """Close this link's MR of a region (waits out packets into it); the engine then says Gone."""
        with self.lock:
            found = self._mrs.pop(region_id, None)
            self._regions.pop(region_id, None)
            if found is not None and found[2]:
                found[0].close()

    def region_gone(self, region_id: int) -> None:
        """Stop announcing a deregistered region (under fence="qp" its MR was the engine's), say Gone."""
        with self.lock:
            self._mrs.pop(region_id, None)
        super().region_gone(region_id)

    # -- the data path (the progress thread) -------------------------------------------------
    def poll(self) -> list[tuple[int, bytes | None]] | None:
        """`(seq, payload)` of the notes that arrived; None once the link is dead."""
        api = self._dev.api
        out, broken = [], None
        with self.lock:
            if self.dead or self.cq is None:
                return None
            _, wcs = self.cq.poll(self._dev.credits * len(self.qps))
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
            if len(self._partial) > len(self.qps) * self._dev.credits:
                raise ProtocolError(f"{len(self._partial)} striped transfers half-arrived: more than credits")
            return None
        del self._partial[note.seq]
        return note.seq, got[1]

    @property
    def partial(self) -> int:
        """Striped transfers some of whose rails' notes arrived (tests)."""
        return len(self._partial)

    # -- the fence's core -------------------------------------------------------------------------
    def revoke(self) -> None:
        """Close every MR of this link (lock held): returns when no packet can land through them.

        Under fence="qp" the MRs are the engine's, shared: nothing is closed here.
        Total: an MR whose close raised stays (the next `revoke` retries it),
        the others are closed anyway; one `CloseError` names each that failed.
        """
        def close(rid: int) -> None:
            mr, _, ours = self._mrs[rid]
            if ours:
                mr.close()
            del self._mrs[rid]

        closing.each(f"verbs link from {self.sender}: its MRs", list(self._mrs), close,
                     name=lambda rid: f"MR of region {rid}")

    def stop_path(self) -> None:
        """QPs to ERR, every MR of this link closed (no DMA after), QPs destroyed; then let the regions go.

        Every step runs even if an earlier one raised (one `CloseError` naming
        each); what failed to close is kept, so the next fence retries it.
        """
        api = self._dev.api
        failures: list[tuple[str, BaseException]] = []

        def attempt(what: str, step: Any) -> bool:
            try:
                step()
            except Exception as exc:  # collected: the next step runs anyway
                failures.append((what, exc))
                return False
            return True

        def to_err(qp: Any) -> None:
            try:
                qp.modify(*build.err_attr(api))
            except api.PyverbsError as exc:  # a QP already in ERR: nothing to stop
                log.warning("verbs: moving a QP of %s to ERR failed: %s", self.sender, exc)

        with self.lock:
            for qp in self.qps:
                attempt("moving a QP to ERR", lambda qp=qp: to_err(qp))
            attempt("closing the link's MRs", self.revoke)
            self.qps = [qp for qp in self.qps if not attempt("destroying a QP", qp.close)]
            if self._slots_mr is not None and attempt("closing the slots MR", self._slots_mr.close):
                self._slots_mr = None
            if self.cq is not None and attempt("destroying the CQ", self.cq.close):
                self.cq = None
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:  # their children for this link are closed already: forget them
            attempt("forgetting a region's link MR", lambda region=region: region.drop(
                ("verbs-link", self.serial)))
        if failures:
            raise CloseError(f"verbs link from {self.sender}: stopping its data path",
                             failures) from failures[0][1]
