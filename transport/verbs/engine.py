"""The verbs engine on the kit: RC QPs on pyverbs, one-way links, per-link MRs, one progress thread.

What is verbs' here: the device context and PD (`device.Device`, the narrow
view every link gets), one engine-wide MR per region (`device.LocalMR`, the
region's child: LOCAL_WRITE for the lkey of SGEs, plus REMOTE_WRITE when
`fence="qp"` shares it with every link), the inbound links
(`inbound.InboundPeer`: per-link QPs and MRs, the fence) and outbound links
(`send.VerbsLink`: WR windows, credits), and the progress thread
(`progress.Progress`). Everything else — the hardened listener, bounded
dials, the write checks, pending handles, the post queue that waits out a
CUDA producer, notify delivery, the fence refusal, close order — is the
kit's. Attributes and WRs are built in `build`, frames live in `wire`,
memory registration in `mem`, and the verbs themselves come from `api`:
real pyverbs for `VerbsEngine` ("verbs", registered through `hw`, which is
listed only when an ACTIVE port exists), or the software fabric for
`sim.SoftVerbsEngine` ("verbs-sim"), which runs the same code in one
process so every test run exercises it.

Links are one-way, as in the nixl backend: an outbound QP has no remote
access at all; an inbound QP accepts writes only through that link's MRs,
whose rkeys only that sender learned. So fencing one sender (`drop_peer`)
touches nothing of the others. `fence="qp"` trades that for one
registration per region: its `capabilities.fence` is False and `drop_peer`
refuses.
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pdxfer.transport.verbs.api as verbs_api  # absolute: `from . import` depends on verbs/__init__

from ..base import Capabilities
from ..control import LinkRegions
from ..engine import EngineBase
from ..errors import CapabilityError
from ..link import Link
from ..listener import DEFAULT_MAX_PENDING, Slot
from ..regions import Region
from .device import MAX_RAILS, Device, LocalMR
from .inbound import InboundPeer
from .mem import access_flags, close_dmabufs, register_mr
from .progress import Progress
from .send import VerbsLink

log = logging.getLogger(__name__)
MAX_SGE = 16  # more SGEs per WR buys little and costs WQE size
MAX_MSG = 1 << 30  # an SGE length is u32; 1 GiB keeps every WR well inside it
FENCES = ("mr", "qp")


class VerbsEngine(EngineBase):
    """A verbs transport engine on the first ACTIVE RDMA port (or the pinned one)."""

    name = "verbs"
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=True, cross_process=True,
        one_sided=True, notify=True, read=False,
    )
    MAX_RAILS = MAX_RAILS

    @classmethod
    def capabilities_for(cls, options: Mapping[str, Any]) -> Capabilities:
        fence = options.get("fence", "mr")
        if fence not in FENCES:
            raise CapabilityError(f"fence={fence!r}: use 'mr' (per-link MRs, a real fence) or 'qp'")
        # "qp" leaves a packet already in flight free to land after its QP went to ERR: no fence
        return replace(cls.capabilities, fence=fence == "mr")

    @staticmethod
    def load_api() -> Any:
        """The verbs namespace this engine runs on (real pyverbs; the fabric for verbs-sim)."""
        return verbs_api.load()

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str | None = None,
        port_num: int | None = None,
        gid_index: int | None = None,
        sq_depth: int = 256,
        credits: int = 32,
        rails: int = 1,
        fence: str = "mr",
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`host`/`port`: the control listener. `device`/`port_num`/`gid_index` pin the NIC
        port and GID (default: first ACTIVE port, first RoCE v2 GID). `sq_depth`: WRs in flight
        per link; `credits`: notes a sender may have unacknowledged per rail; `rails`: QPs per
        outbound link that large transfers stripe over (1..MAX_RAILS). `fence`: "mr" (default:
        per-link MRs, `drop_peer` deregisters them — no DMA after it returns) or "qp" (one
        shared MR per region: cheaper registration, but nothing can stop a packet in flight,
        so `capabilities.fence` is False and `drop_peer` refuses). `connect_timeout` bounds a
        whole dial and every inbound handshake; `max_pending` caps inbound connections still
        in their handshake."""
        super().__init__(connect_timeout=connect_timeout, options={"fence": fence})
        if isinstance(rails, bool) or not isinstance(rails, int) or not 1 <= rails <= MAX_RAILS:
            raise CapabilityError(f"rails={rails!r}: use 1..{MAX_RAILS} QPs per link")
        api = self.load_api()
        ctx, p = verbs_api.pick_port(api, device, port_num, gid_index)
        try:
            sq = max(4, min(sq_depth, p.max_qp_wr))
            self.dev = Device(
                api=api, ctx=ctx, pd=api.PD(ctx), port=p, sq_depth=sq,
                signal_every=max(1, sq // 4),
                # Every rail's CQEs share one CQ per link, which the device caps at max_cqe.
                rails=max(1, min(rails, (p.max_cqe - 8) // (2 * sq + 8))),
                credits=max(1, min(credits, p.max_qp_wr, (p.max_cqe - 8) // MAX_RAILS)),
                max_sge=max(1, min(p.max_sge, MAX_SGE)), max_msg=max(4096, min(p.max_msg_sz, MAX_MSG)),
                fence=fence, dmabufs={})
            self._idle = True  # the progress thread stopped at close (else the device is left open)
            self._shared = LinkRegions(self.regions, self.inbound, InboundPeer)  # every link, every region
            self._serial = itertools.count(1)
            self._progress = Progress(self.engine_id, self.outbound, self._shared)
        except BaseException:
            ctx.close()
            raise
        try:
            self.listen(host, port, max_pending)
        except BaseException:
            self._progress.stop()
            ctx.close()
            raise

    def why_no_fence(self) -> str:
        return ("it was created with fence='qp': one MR per region is shared by every link, and "
                "a packet already in flight may land after its QP went to ERR; use fence='mr'")

    # -- memory -------------------------------------------------------------------------
    def on_register(self, region: Region) -> None:
        dev = self.dev
        mr, base = register_mr(dev.api, dev.pd, region, access_flags(dev.api, dev.fence == "qp"),
                               dev.dmabufs)
        region.adopt("mr", LocalMR(mr, base))
        self._shared.registered(region)

    def on_deregister(self, region: Region) -> None:
        self._shared.deregistered(region)

    # -- links ------------------------------------------------------------------------------
    def open_link(self, address: dict[str, Any]) -> Link:
        return VerbsLink(self.link_context(), self.dials, address, self.dev, self._progress.kick)

    def accept(self, sock: socket.socket, where: str, slot: Slot) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = InboundPeer(self.inbound, sock, where, slot, engine_id=self.engine_id,
                           serial=next(self._serial), dev=self.dev, admit=self._shared.admit)
        if not (self.inbound.track(peer) and peer.start(peer.run, f"verbs-in {where}")):
            slot.admitted()  # closing: nothing more is served
            sock.close()

    # -- lifecycle ------------------------------------------------------------------------------
    def release(self) -> None:
        self._idle = self._progress.stop()

    def after_close(self) -> None:
        if not self._idle:  # a notify handler is stuck: leave the device to the GC
            log.warning("verbs engine %s: progress thread still busy at close", self.engine_id)
            return
        self.dev.ctx.close()
        close_dmabufs(self.dev.dmabufs)
