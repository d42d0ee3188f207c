"""The verbs backend: RC QPs on pyverbs, one-way links, per-link MRs, a polling progress thread.

What this module owns: the device context and PD, one engine-wide MR per
region (LOCAL_WRITE only: the lkey for SGEs), the control listener, the
inbound links (`verbs_peer.InboundPeer`: per-link QP and MRs, the fence) and
outbound links (`verbs_conn.VerbsConnection`: WR windows, acks), and the one
progress thread that polls every link's CQ. Attributes and WRs are built in
`verbs_build`, frames live in `verbs_wire`, memory registration in
`verbs_mem`, and the verbs themselves come from `verbs_api` — real pyverbs
for `VerbsEngine` ("verbs", registered through `verbs_hw`, which is listed
only when an ACTIVE port exists), or the software fabric for
`SoftVerbsEngine` ("verbs-sim", `soft_verbs`), which runs the same code in
one process so every test run exercises it.

Links are one-way, as in the nixl backend: an outbound QP has no remote
access at all; an inbound QP accepts writes only through that link's MRs,
whose rkeys only that sender learned. So fencing one sender (`drop_peer`)
touches nothing of the others.

Progress: one thread polls every CQ (never `CompChannel.get_cq_event`: on
rdma-core 44 it blocks holding the GIL). It spins while completions come and
backs off to `IDLE_POLL` when idle; `write()` kicks it. Notify handlers run
on it, outside every link lock, so a handler may call `drop_peer`.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from dataclasses import replace
from typing import Any

import torch

from . import verbs_api
from .base import Capabilities, LocalRegion, NotifyHandler, TransportEngine
from .control_link import accept_loop, shut_listener
from .errors import CapabilityError, ClosedError, PeerLostError, TransportError
from .peering import SocketPeers
from .regions import Region, RegionTable
from .verbs_conn import VerbsConnection
from .verbs_mem import access_flags, close_dmabufs, register_mr
from .verbs_peer import InboundPeer
from .verbs_wire import Welcome

log = logging.getLogger(__name__)
IDLE_POLL = 0.002  # longest sleep of an idle progress thread (s)
MAX_SGE = 16  # more SGEs per WR buys little and costs WQE size
MAX_MSG = 1 << 30  # an SGE length is u32; 1 GiB keeps every WR well inside it


class VerbsEngine(SocketPeers, TransportEngine):
    """A verbs transport engine on the first ACTIVE RDMA port (or the pinned one)."""

    name = "verbs"
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=True, cross_process=True,
        one_sided=True, notify=True, read=False,
    )

    MAX_RAILS = 16

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        return replace(cls.capabilities, fence=options.get("fence", "mr") == "mr")

    @staticmethod
    def _load_api() -> Any:
        return verbs_api.load()

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int | None = None,
        *,
        device: str | None = None,
        port_num: int | None = None,
        gid_index: int | None = None,
        sq_depth: int = 256,
        credits: int = 32,
        rails: int = 1,
        fence: str = "mr",
        connect_timeout: float = 10.0,
    ) -> None:
        """`host`/`port`: the control listener. `device`/`port_num`/`gid_index` pin the NIC
        port and GID (default: first ACTIVE port, first RoCE v2 GID). `sq_depth`: WRs in flight
        per link; `credits`: notes a sender may have unacknowledged per rail; `rails`: QPs per
        outbound link that large transfers stripe over (1..MAX_RAILS). `fence`: "mr" (default:
        per-link MRs, `drop_peer` deregisters them — no DMA after it returns) or "qp" (one
        shared MR per region, `drop_peer` is QP->ERR + destroy only: cheaper registration, but
        a packet already in flight may still land after it returns). `streams` is unused."""
        del streams
        if fence not in ("mr", "qp"):
            raise CapabilityError(f"fence={fence!r}: use 'mr' (per-link MRs, a real fence) or 'qp'")
        self.fence = fence
        # "qp" leaves a packet already in flight free to land after drop_peer: no fence
        self.capabilities = replace(type(self).capabilities, fence=fence == "mr")
        self.api = self._load_api()
        self.engine_id = f"{self.name}-{uuid.uuid4().hex[:12]}"
        self.connect_timeout = connect_timeout
        self.ctx, self.port = verbs_api.pick_port(self.api, device, port_num, gid_index)
        self.pd = self.api.PD(self.ctx)
        self.sq_depth = max(4, min(sq_depth, self.port.max_qp_wr))
        self.signal_every = max(1, self.sq_depth // 4)
        if not 1 <= rails <= self.MAX_RAILS:
            self.ctx.close()
            raise CapabilityError(f"rails={rails}: use 1..{self.MAX_RAILS} QPs per link")
        # Every rail's CQEs share one CQ per link, which the device caps at max_cqe.
        self.rails = max(1, min(rails, (self.port.max_cqe - 8) // (2 * self.sq_depth + 8)))
        self.credits = max(1, min(credits, self.port.max_qp_wr,
                                  (self.port.max_cqe - 8) // self.MAX_RAILS))
        self.max_sge = max(1, min(self.port.max_sge, MAX_SGE))
        self.max_msg = max(4096, min(self.port.max_msg_sz, MAX_MSG))
        self.regions = RegionTable(self.name, self.engine_id, cuda=self.capabilities.cuda_memory)
        self._lock = threading.Lock()  # regions, links, closed
        self._closed = False
        self._handler: NotifyHandler | None = None
        self._live: dict[int, Region] = {}
        self._retired: list[Region] = []  # deregistered, kept alive for WRs already posted
        self._local: dict[int, tuple[Any, int]] = {}  # region id -> (engine-wide MR, base)
        self._dmabufs: dict[int, int] = {}
        self._peers: set[InboundPeer] = set()
        # Every inbound peer whose thread may still run: a peer leaves `_peers`
        # in its thread's last steps, so close() joins these (pruned per accept).
        self._started: set[InboundPeer] = set()
        self._outbound: dict[str, VerbsConnection] = {}
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            self.ctx.close()
            raise TransportError(f"verbs engine cannot listen on {host}:{port}: {exc}") from exc
        bound = self._listener.getsockname()
        self._host = socket.gethostname() if host in ("", "0.0.0.0", "::") else bound[0]
        self._port = bound[1]
        self._wake = threading.Event()
        self._progress = threading.Thread(target=self._poll_loop, daemon=True,
                                          name=f"verbs-progress {self._port}")
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"verbs-accept {self._port}")
        self._progress.start()
        self._acceptor.start()

    # -- memory -------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        with self._lock:
            self._check_open()
            region = self.regions.register(tensor)
            try:
                self._local[region.region_id] = register_mr(  # shared with every link under fence="qp"
                    self.api, self.pd, region, access_flags(self.api, self.fence == "qp"), self._dmabufs)
                for peer in list(self._peers):
                    peer.add_region(region)
            except BaseException:
                self._undo(region)
                raise
            self._live[region.region_id] = region
        return region

    def _undo(self, region: Region) -> None:
        self.regions.deregister(region)
        for peer in list(self._peers):
            peer.drop_region(region.region_id, tell=False)
        found = self._local.pop(region.region_id, None)
        if found is not None:
            found[0].close()

    def deregister(self, region: LocalRegion) -> None:
        """Forget a region: every link's MR over it is closed (waiting out packets into it)."""
        self.regions.deregister(region)
        with self._lock:
            live = self._live.pop(getattr(region, "region_id", -1), None)
            if live is not region:
                if live is not None:
                    self._live[live.region_id] = live
                return
            self._retired.append(live)
            peers = list(self._peers)
            found = self._local.pop(live.region_id, None)
        if found is not None:
            found[0].close()
        for peer in peers:
            peer.drop_region(live.region_id)

    def _local_key(self, region: Region) -> tuple[int, int]:
        """`(lkey, base)` of a live local region's engine-wide MR."""
        found = self._local.get(region.region_id)
        if found is None:
            raise ClosedError(f"verbs engine {self.engine_id}: region {region.region_id} is not registered")
        return found[0].lkey, found[1]

    # -- peers --------------------------------------------------------------
    def _new_connection(self, host: str, port: int, peer: str) -> VerbsConnection:
        return VerbsConnection(self, host, port, peer)

    def has_peer(self, engine_id: str) -> bool:
        with self._lock:
            return any(p.sender == engine_id for p in self._peers)

    def drop_peer(self, engine_id: str) -> None:
        with self._lock:
            peers = [p for p in self._peers if p.sender == engine_id]
        for peer in peers:
            peer.fence()

    def _accept_loop(self) -> None:
        accept_loop(self, self._listener, self._start_peer)

    def _start_peer(self, sock: socket.socket, where: str) -> None:
        peer = InboundPeer(self, sock, where)
        with self._lock:
            self._started = {p for p in self._started if p.alive}
            self._started.add(peer)
        peer.start()

    def _admit(self, peer: InboundPeer, hello: Any) -> Welcome:
        """Build a new inbound link's QP and MRs over every live region, and welcome it."""
        with self._lock:
            if self._closed:
                raise PeerLostError(f"verbs engine {self.engine_id} is closing")
            self._peers.add(peer)
            try:
                qpns, psns = peer.build(hello, list(self._live.values()))
            except self.api.PyverbsError as exc:
                raise TransportError(f"cannot build the link from {hello.engine}: {exc}") from exc
        p = self.port
        return Welcome(self.engine_id, qpns, psns, p.lid, p.gid, p.mtu, peer.region_rows(), self.credits)

    def _forget(self, peer: InboundPeer) -> None:
        with self._lock:
            self._peers.discard(peer)

    def _disconnect(self, conn: VerbsConnection) -> None:
        with self._lock:
            if self._outbound.get(conn.peer) is conn:
                del self._outbound[conn.peer]

    # -- progress -----------------------------------------------------------
    def _kick(self) -> None:
        self._wake.set()

    def _poll_loop(self) -> None:
        idle = 0
        while not self._closed:
            with self._lock:
                conns, peers = list(self._outbound.values()), list(self._peers)
            busy = False
            for conn in conns:
                busy |= conn.poll()
            for peer in peers:
                notes = peer.poll()
                if not notes:
                    continue
                busy = True
                seqs = []
                for seq, payload in notes:
                    if peer.dead:  # fenced meanwhile: nothing more of this sender is delivered
                        break
                    if payload is not None:
                        self._deliver(peer.sender, payload)
                    seqs.append(seq)
                peer.ack(seqs)
            if busy:
                idle = 0
                continue
            idle += 1
            self._wake.wait(min(IDLE_POLL, 2e-5 * idle))
            self._wake.clear()

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"verbs engine {self.engine_id} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outbound = list(self._outbound.values())
            peers = list(self._peers)
            started = list(self._started | self._peers)
        shut_listener(self._listener)
        for peer in peers:
            peer.fence()
        for conn in outbound:
            conn.close()
        self._wake.set()
        self._progress.join(5.0)
        self._acceptor.join(2.0)
        for peer in started:
            peer.join(2.0)
        if self._progress.is_alive():  # a notify handler is stuck: leave the device to the GC
            log.warning("verbs engine %s: progress thread still busy at close", self.engine_id)
            return
        for mr, _ in self._local.values():
            mr.close()
        self._local.clear()
        self.ctx.close()
        close_dmabufs(self._dmabufs)
        self.regions.clear()
        self._live.clear()
        self._retired.clear()


class SoftVerbsEngine(VerbsEngine):
    """The verbs backend on the software fabric (`soft_verbs`): one process, no NIC needed."""

    name = "verbs-sim"
    capabilities = Capabilities(
        cuda_memory=False, cuda_zero_copy=False, cross_process=False,
        one_sided=True, notify=True, read=False,
    )

    @staticmethod
    def _load_api() -> Any:
        return verbs_api.soft()
