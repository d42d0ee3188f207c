"""The sending side of one verbs link: RC QPs, the peer's rkeys, windows of linked WRs.

A `VerbsLink` is the kit's `ControlledLink` (`transport.control`). It creates
one CQ and `rails` RC QPs with `qp_access_flags=0` (nothing can write into
us through an outbound link), dials the peer under one deadline saying
`Hello` with its QPs, learns the receiver's QPs, regions and rkeys from
`Welcome`, and moves its QPs to RTS.

A write, after the kit's checks: `plan` — on the caller's thread, with no
lock held — cuts a transfer of at least `RAIL_MIN` bytes per rail into
byte-balanced stripes, one per rail, plans each (`build.plan_wrs`: sorted,
coalesced, split at the port's max message size, dst-contiguous rows
gathered into multi-SGE WRs) and builds its WRITE WRs (`build.write_wrs`,
~10-15 us of Python each: the expensive part, so never under the link
lock). `submit`, under the lock, only appends them and each stripe's `Note`
marker to the rails' queues, in order; `_pump` posts as many as each SQ has
free slots as one linked list — one doorbell per window — while the
progress thread posts the rest as completions free slots. Every
`signal_every`-th WR and every note is signaled, and its wr_id is the
number of SQ slots its completion frees. A note needs a credit (a receive
the peer has posted); each acknowledged transfer returns one per rail it
used, so the peer never sees RNR.

The handle completes when the receiver's `Acks` names it — after its notes
arrived (RC: after every WRITE before them) and its notify ran. Any error —
an error completion (named by its WC status), a closed control socket, a
protocol violation — severs the link: handles fail, the QPs go to ERR and
are destroyed, and the next `connect()` builds a fresh one.

Draining (`fence="qp"`: the receiver cannot revoke what we write, #25.1):
before its `Bye` a dead link moves its QPs to ERR and posts one signaled
marker per rail; RC flushes a send queue in order, so the marker's
completion comes after every WR posted before it has completed or been
flushed — none of them puts a packet on the wire any more. Only then does
it say `Bye(quiet=True)`.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pdxfer.transport.verbs.build as build  # absolute: `from . import` depends on verbs/__init__
import pdxfer.transport.verbs.wire as verbs_wire

from ..control import ControlledLink
from ..dial import Dials
from ..errors import PeerLostError, ProtocolError, TransportError
from ..link import LinkContext, Remote
from ..posting import Post
from ..regions import Region
from ..segments import balanced_parts
from .api import wc_error
from .device import Device, local_key
from .wire import SLOT, Hello, Regions, pack_note

RAIL_MIN = 1 << 20  # a transfer is striped over one rail per this many bytes, up to `rails`
DRAIN_MARK = 1 << 40  # wr_id of the marker a draining rail posts (no window frees this many slots)
DRAIN_POLL = 0.002  # longest pause between two looks at a draining link's CQ (s)


class _Rail:
    """One QP of a link and its share of the stream: queue, WR ids, SQ slots, note credits."""

    __slots__ = ("completed", "credits", "index", "notes", "posted", "psn", "qp", "queue")

    def __init__(self, index: int, qp: Any) -> None:
        self.index, self.qp, self.psn = index, qp, random.getrandbits(24)
        self.queue: collections.deque = collections.deque()  # SendWR, or (slots it frees, note bytes)
        self.completed = self.posted = self.notes = self.credits = 0


def region_table(data: bytes) -> dict[int, Remote]:
    """`{region: Remote(length, (address, rkey))}` from a `Welcome`/`Regions` table."""
    if len(data) % 32:
        raise ProtocolError(f"region table of {len(data)} B is not whole (id, addr, len, rkey) rows")
    rows = np.frombuffer(data, dtype="<i8").reshape(-1, 4).tolist()
    return {r: Remote(n, (a, k)) for r, a, n, k in rows}


class VerbsLink(ControlledLink):
    """A link to one peer engine: QPs, control socket, the peer's regions, transfers awaiting acks."""

    WIRE = verbs_wire

    def __init__(self, ctx: LinkContext, dials: Dials, address: dict[str, Any], dev: Device,
                 kick: Callable[[], None]) -> None:
        api = dev.api
        # One send CQ for every rail: at most 2 CQEs per SQ slot (signaled + flushed) each.
        cq = api.CQ(dev.ctx, dev.rails * (2 * dev.sq_depth + 8))
        rails = [_Rail(i, api.QP(dev.pd, build.qp_init_attr(api, cq, dev.sq_depth, 1, dev.max_sge)))
                 for i in range(dev.rails)]
        self._dev, self._kick, self._cq, self._rails = dev, kick, cq, rails
        self._mr: Any = None
        self._used: dict[int, int] = {}  # seq -> rails it used (credits to return on its ack)
        self.wrs = self.doorbells = 0  # counters for benchmarks and tests
        p = dev.port
        hello = Hello(ctx.engine_id, [r.qp.qp_num for r in rails], [r.psn for r in rails],
                      p.lid, p.gid, p.mtu)
        try:
            super().__init__(ctx, dials, address, hello, ctx.backend)
        except BaseException:
            self.hang_up_path()
            raise
        self._by_qpn = {r.qp.qp_num: r for r in rails}
        try:
            welcome = self._connect(self.welcome)
            self._credits = welcome.credits
            for rail in rails:
                rail.credits = welcome.credits
            self._note_buf = np.zeros(len(rails) * welcome.credits * SLOT, np.uint8)
            self._note_base = int(self._note_buf.ctypes.data)
            self._mr = api.MR(dev.pd, self._note_buf.nbytes,
                              int(api.E.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE), address=self._note_base)
        except BaseException:
            self.sock.close()
            self.hang_up_path()
            raise
        self.start_reader()

    def _connect(self, welcome: Any) -> Any:
        dev, api = self._dev, self._dev.api
        p = dev.port
        if not 0 < welcome.credits <= 4096:
            raise ProtocolError(f"welcome offers {welcome.credits} credits; expected 1..4096")
        if (len(welcome.qpns) != len(self._rails) or len(welcome.psns) != len(self._rails)
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24
                           for v in welcome.qpns + welcome.psns)):
            raise ProtocolError(f"welcome names QPs {welcome.qpns!r} / PSNs {welcome.psns!r} for our "
                                f"{len(self._rails)} rails; expected that many 24-bit ints of each")
        self.peer_regions = region_table(welcome.regions)
        path = dev.path(welcome.lid, welcome.gid)
        for rail, qpn, psn in zip(self._rails, welcome.qpns, welcome.psns, strict=True):
            attr = build.connect_attr(api, mtu=min(p.mtu, welcome.mtu), access=0, dest_qpn=qpn,
                                      rq_psn=psn, sq_psn=rail.psn, **path)
            try:
                rail.qp.to_rts(attr)
            except api.PyverbsError as exc:
                raise PeerLostError(f"cannot connect a QP to {self.peer}: {exc}") from exc
        return welcome

    # -- the kit's hooks -----------------------------------------------------------------
    def plan(self, src: Region, dst: Remote, table: np.ndarray) -> Any:
        """The WRITE WRs of each stripe, built here: on the caller's thread, no lock held."""
        dev = self._dev
        nbytes = int(table[:, 2].sum()) if table.shape[0] else 0
        # Striped over rails by bytes: each rail's note lands after that rail's WRITEs, and the
        # receiver delivers notify once every rail's note is in. Small transfers use one rail.
        stripes = min(len(self._rails), max(1, -(-nbytes // RAIL_MIN)))
        parts = balanced_parts(table, stripes) if stripes > 1 else [table]
        lkey, src_base = local_key(src)
        base, rkey = dst.info
        return [build.write_wrs(dev.api, *build.plan_wrs(part, dev.max_sge, dev.max_msg),
                                src_base=src_base, lkey=lkey, dst_base=base, rkey=rkey,
                                signal_every=dev.signal_every) for part in parts]

    def submit(self, post: Post) -> None:
        stripes = post.table
        self._used[post.seq] = len(stripes)
        every = self._dev.signal_every
        for rail, wrs in zip(self._rails, stripes, strict=False):
            rail.queue.extend(wrs)
            last = rail.index == len(stripes) - 1
            rail.queue.append((build.note_frees(len(wrs), every),
                               pack_note(post.seq, rail.index, len(stripes), post.notify if last else None)))
            self._pump(rail)
        self._kick()

    def on_acked(self, seq: int) -> None:
        for rail in self._rails[:self._used.pop(seq, 0)]:
            rail.credits += 1  # the peer reposted that rail's slot before acking

    def acked(self, seqs: list[int]) -> int:
        unknown = super().acked(seqs)
        with self.lock:
            for rail in self._rails:
                self._pump(rail)
        return unknown

    def regions(self, msg: Regions) -> None:
        self.peer_regions = region_table(msg.regions)

    def on_sever(self, error: TransportError) -> None:
        with self.lock:
            for rail in self._rails:
                rail.queue.clear()
            self._used.clear()
        super().on_sever(error)

    def drain(self, deadline: float) -> bool:
        """QPs to ERR, a marker per rail, and its flush completion reaped: no WR of ours still runs."""
        api = self._dev.api
        with self.lock:
            if self._cq is None or self._mr is None:
                return True  # never connected: nothing was posted
            rails = {rail.qp.qp_num: rail for rail in self._rails}
            for rail in rails.values():
                try:
                    rail.qp.modify(*build.err_attr(api))
                except api.PyverbsError:
                    pass  # already in ERR (an error completion put it there)
        marked: set[int] = set()
        pause = 0.0
        while rails:
            with self.lock:
                for qpn, rail in rails.items():
                    if qpn not in marked:
                        marker = build.note_wr(api, DRAIN_MARK, self._note_base, 1, self._mr.lkey)
                        try:
                            rail.qp.post_send(marker)
                            marked.add(qpn)
                        except api.PyverbsError:
                            pass  # its SQ is full: the flushes reaped below make room
                _, wcs = self._cq.poll(64)
            for wc in wcs:
                if int(wc.wr_id) == DRAIN_MARK:
                    rails.pop(wc.qp_num, None)
            if not rails:
                return True
            if time.monotonic() >= deadline:
                return False
            pause = 0.0 if wcs else min(DRAIN_POLL, pause * 2 + 2e-5)  # a CQ has no event to wait on
            time.sleep(pause)
        return True

    def hang_up_path(self) -> None:
        """QPs to ERR, then destroy QPs, note MR and CQ (under the lock: no poll is running)."""
        api = self._dev.api
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.acquire()
        try:
            rails, self._rails = self._rails, []
            for rail in rails:
                try:
                    rail.qp.modify(*build.err_attr(api))
                except api.PyverbsError:
                    pass
                rail.qp.close()
            mr, self._mr = self._mr, None
            if mr is not None:
                mr.close()
            cq, self._cq = self._cq, None
            if cq is not None:
                cq.close()
        finally:
            if lock is not None:
                lock.release()

    # -- the WR windows ---------------------------------------------------------------------
    def _pump(self, rail: _Rail) -> None:
        """Post one window on `rail`: as many queued WRs as its SQ has slots, linked, one doorbell."""
        dev, api = self._dev, self._dev.api
        free = dev.sq_depth - (rail.posted - rail.completed)
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

    # -- progress (the engine's progress thread) -----------------------------------------------
    def poll(self) -> bool:
        """Reap send completions and post what they freed room for; True if any arrived."""
        with self.lock:
            if self.error is not None or self._cq is None:
                return False
            n, wcs = self._cq.poll(64)
            for wc in wcs:
                if wc.status != self._dev.api.E.ibv_wc_status.IBV_WC_SUCCESS:
                    self.sever(wc_error(self._dev.api, wc, self.peer))
                    return True
                self._by_qpn[wc.qp_num].completed += int(wc.wr_id)  # the slots it frees
            if n:
                for rail in self._rails:
                    self._pump(rail)
            return bool(n)

    @property
    def qpns(self) -> list[int]:
        """This link's QP numbers, one per rail (tests, fault injection)."""
        return [r.qp.qp_num for r in self._rails]

    @property
    def qps(self) -> list[Any]:
        """This link's QPs, one per rail (the hardware suite reads their address vectors back)."""
        return [r.qp for r in self._rails]
