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
memory registration in `mem` (CUDA allocations, dma-buf exports and
flushes: `cuda`), and the verbs themselves come from `api`: real pyverbs
for `VerbsEngine` ("verbs", registered through `hw`, which is listed only
when an ACTIVE port exists), or the software fabric for
`sim.SoftVerbsEngine` ("verbs-sim"), which runs the same code in one
process so every test run exercises it.

Which NIC (`nics`): the constructor finds the ACTIVE ports; the choice
waits for the first `register()` or link, so that an engine whose first
region is CUDA memory takes the port nearest to that GPU (`topology`). A
pinned `device=` (or a host with one port) is chosen at once. `describe()`
and the INFO log line name the choice and why.

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
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pdxfer.transport.verbs.api as verbs_api  # absolute: `from . import` depends on verbs/__init__
import pdxfer.transport.verbs.nics as nics
import pdxfer.transport.verbs.topology as topology

from ..base import Capabilities
from ..control import LinkRegions
from ..engine import EngineBase
from ..errors import CapabilityError
from ..link import Link
from ..listener import DEFAULT_MAX_PENDING, Slot
from ..regions import Region
from .cuda import CudaDriver, DmaBufs, Flushes
from .device import MAX_RAILS, Device, LocalMR
from .inbound import InboundPeer
from .mem import access_flags, prepare, register_mr
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

    @staticmethod
    def load_host() -> tuple[Any, str]:
        """The CUDA driver and the sysfs root this engine asks (the fabric's double and tree for verbs-sim)."""
        return CudaDriver(), "/sys"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str | None = None,
        port_num: int | None = None,
        gid_index: int | None = None,
        hop_limit: int = 64,
        traffic_class: int = 0,
        sl: int = 0,
        sq_depth: int = 256,
        credits: int = 32,
        rails: int = 1,
        fence: str = "mr",
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`host`/`port`: the control listener. `device`/`port_num` pin the NIC and port (default:
        the port nearest the GPU of the first CUDA region, else the port holding `host`'s address,
        else the first ACTIVE one); `gid_index` pins the GID (default: the RoCE v2 GID of `host`'s
        address, else of its family, never a link-local one if another exists; InfiniBand: 0).
        `hop_limit` (1..255, default 64), `traffic_class` (0..255) and `sl` (0..15) go into every
        QP's address vector (a lossless RoCE class is chosen by traffic class or SL; pyverbs'
        default hop limit of 1 would die at the first router). `sq_depth`: WRs in flight per link;
        `credits`: notes a sender may have unacknowledged per rail; `rails`: QPs per outbound link
        that large transfers stripe over (1..MAX_RAILS). `fence`: "mr" (default: per-link MRs,
        `drop_peer` deregisters them — no DMA after it returns) or "qp" (one shared MR per region:
        registration once per region instead of once per region and peer — time and, for GPU
        memory, BAR1 space — but nothing can stop a packet in flight, so `capabilities.fence` is
        False and `drop_peer` refuses). `connect_timeout` bounds a whole dial and every inbound
        handshake; `max_pending` caps inbound connections still in their handshake."""
        super().__init__(connect_timeout=connect_timeout, options={"fence": fence})
        if isinstance(rails, bool) or not isinstance(rails, int) or not 1 <= rails <= MAX_RAILS:
            raise CapabilityError(f"rails={rails!r}: use 1..{MAX_RAILS} QPs per link")
        if gid_index is not None and (isinstance(gid_index, bool) or not isinstance(gid_index, int)
                                      or gid_index < 0):
            raise CapabilityError(f"verbs option gid_index must be a non-negative int, got {gid_index!r}")
        self._route = nics.Route.checked(hop_limit, traffic_class, sl)
        self._api = self.load_api()
        self._cuda, self._sysfs = self.load_host()
        self._ports, skipped = nics.scan(self._api, device, port_num, self._sysfs)
        if not self._ports:
            raise CapabilityError(f"no ACTIVE RDMA port ({'; '.join(skipped) or 'none found'}); "
                                  "bring a link up or pin device=/port_num=")
        self._bound = nics.bound_address(host)
        self._pinned, self._gid_index = device is not None, gid_index
        self._sizes = (sq_depth, credits, rails, fence)
        self._dev: Device | None = None
        self._choosing = threading.Lock()
        self._gpus_checked: set[int] = set()
        self._dmabufs, self._flushes = DmaBufs(self._cuda), Flushes(self._cuda)
        self._shared = LinkRegions(self.regions, self.inbound, InboundPeer)  # every link, every region
        self._serial = itertools.count(1)
        self._progress = Progress(self.engine_id, self.outbound, self._shared, self._flushes,
                                  on_failure=self.progress_failed)
        try:
            if self._pinned or len(self._ports) == 1:  # nothing for a GPU to decide later
                self._device(None)
            self.listen(host, port, max_pending)
        except BaseException:
            self._progress.stop()
            if self._dev is not None:
                self._dev.ctx.close()
            raise

    # -- the device ---------------------------------------------------------------------
    def _device(self, gpu: int | None) -> Device:
        """The device this engine runs on, chosen and opened on first need (for `gpu`'s memory)."""
        with self._choosing:
            if self._dev is not None:
                return self._dev
            info, why = nics.choose_port(self._ports, host=self._bound, gpu=self._gpu_place(gpu),
                                         pinned=self._pinned)
            gid, gid_why = nics.choose_gid(info, self._bound, self._gid_index)
            ctx, p = nics.open_port(self._api, info, gid, f"{why}; GID {gid.index}: {gid_why}")
            sq_depth, credits, rails, fence = self._sizes
            try:
                sq = max(4, min(sq_depth, p.max_qp_wr))
                self._dev = Device(
                    api=self._api, ctx=ctx, pd=self._api.PD(ctx), port=p, route=self._route,
                    sq_depth=sq, signal_every=max(1, sq // 4),
                    # Every rail's CQEs share one CQ per link, which the device caps at max_cqe.
                    rails=max(1, min(rails, (p.max_cqe - 8) // (2 * sq + 8))),
                    credits=max(1, min(credits, p.max_qp_wr, (p.max_cqe - 8) // MAX_RAILS)),
                    max_sge=max(1, min(p.max_sge, MAX_SGE)),
                    max_msg=max(4096, min(p.max_msg_sz, MAX_MSG)), fence=fence)
            except BaseException:
                ctx.close()
                raise
        log.info("%s", self.describe())
        return self._dev

    def _gpu_place(self, gpu: int | None) -> tuple[str, topology.PciPlace | None] | None:
        if gpu is None:
            return None
        return f"cuda:{gpu}", topology.gpu_place(self._sysfs, self._cuda.bus_id(gpu))

    @property
    def nic(self) -> nics.Port | None:
        """The port and GID this engine uses (None until chosen: the first register() or link)."""
        dev = self._dev
        return dev.port if dev is not None else None

    def describe(self) -> str:
        """Which NIC, port and GID this engine uses and why, and the route its QPs carry."""
        dev = self._dev
        if dev is None:
            ports = ", ".join(f"{p.device}/{p.port_num}" for p in self._ports)
            return (f"verbs engine {self.engine_id}: NIC not chosen yet (at the first register() or "
                    f"link, nearest to a CUDA region's GPU; ACTIVE ports: {ports})")
        p, r = dev.port, dev.route
        kind = "RoCE" if p.ethernet else "InfiniBand"
        return (f"verbs engine {self.engine_id} on {p.device} port {p.port_num} ({kind}, GID {p.gid}, "
                f"LID {p.lid}; {p.why}); hop_limit {r.hop_limit}, traffic_class {r.traffic_class}, "
                f"sl {r.sl}")

    def __repr__(self) -> str:
        return f"<{self.describe()}>"

    def why_no_fence(self) -> str:
        return ("it was created with fence='qp': one MR per region is shared by every link, and "
                "a packet already in flight may land after its QP went to ERR; use fence='mr'")

    # -- memory -------------------------------------------------------------------------
    def on_register(self, region: Region) -> None:
        alloc = prepare(self._cuda, self._dmabufs, self._flushes, region)  # CUDA: allocation, export
        dev = self._device(alloc.gpu if alloc is not None else None)
        if alloc is not None:
            self._check_nic(alloc.gpu)
        mr, base = register_mr(dev.api, dev.pd, region, access_flags(dev.api, dev.fence == "qp"))
        region.adopt("mr", LocalMR(mr, base))
        self._shared.registered(region)  # no engine lock: each link registers its MR on its own

    def _check_nic(self, gpu: int) -> None:
        """Warn once per GPU whose memory is registered on a NIC other than its nearest."""
        if gpu in self._gpus_checked or self._pinned or self._dev is None:
            return
        self._gpus_checked.add(gpu)
        best, why = nics.choose_port(self._ports, host=self._bound, gpu=self._gpu_place(gpu))
        p = self._dev.port
        if (best.device, best.port_num) != (p.device, p.port_num):
            log.warning("verbs engine %s: cuda:%d memory goes through %s/%d, chosen earlier (%s); "
                        "%s/%d is %s. One engine per GPU avoids this.", self.engine_id, gpu,
                        p.device, p.port_num, p.why, best.device, best.port_num, why)

    def on_deregister(self, region: Region) -> None:
        self._shared.deregistered(region)

    # -- links ------------------------------------------------------------------------------
    def open_link(self, address: dict[str, Any]) -> Link:
        return VerbsLink(self.link_context(), self.dials, address, self._device(None), self._progress.kick)

    def accept(self, sock: socket.socket, where: str, slot: Slot) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            dev = self._device(None)
        except CapabilityError as exc:
            log.error("verbs engine %s: cannot serve %s: %s", self.engine_id, where, exc)
            slot.admitted()
            sock.close()
            return
        peer = InboundPeer(self.inbound, sock, where, slot, engine_id=self.engine_id,
                           serial=next(self._serial), dev=dev, admit=self._shared.admit)
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
        if self._dev is not None:
            self._dev.ctx.close()
        self._cuda.close()
