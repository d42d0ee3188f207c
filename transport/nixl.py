"""The nixl backend: UCX through NVIDIA NIXL, here over UCX's tcp transport.

What NIXL brings: registered memory described once, and one posted request
moving a whole list of `(address, length)` pairs with a notification that
lands after the data. What this module adds around it is the contract of
`transport.base`: the shared registration and refusals (`RegionTable`,
`check_table`, before anything is posted), handles that complete when the
receiver confirms, errors translated at this edge, and a real `drop_peer`.

The pieces: `NixlEngine` (here) owns one NIXL agent, named by its engine id,
that registers every region and initiates every write; a control listener;
the inbound links (`nixl_peer.InboundPeer`, each with an agent serving that
one sender); the outbound links (`nixl_conn.NixlConnection`); and the one
polling loop (`nixl_progress.Progress`). Control frames: `nixl_wire`.

The fence, and the trade-off it costs. `drop_peer` must guarantee that no
byte of the dropped peer's earlier writes lands after it returns. With UCX's
shared-memory or RDMA transports (cma, knem, rc) a writer moves bytes into
our memory with no action of ours, and nothing on our side can stop a write
already under way, so we restrict UCX to `tls="tcp"` — passed to the UCX
backend as its `engine_config`, never through the environment — and run
NIXL without its own progress thread. Then bytes land only inside our
progress thread's calls on the link's own agent, and the fence is: lock the
link's agent, mark it dead, destroy it (`nixl_peer.InboundPeer.fence`). The
price is the tcp transport's speed on one host (no cma single-copy) and a
UCX worker per inbound link. `tls` is an option so a deployment that does
not need the fence may widen it; `drop_peer` then refuses with
`CapabilityError` rather than pretend.

Capabilities, per instance: with `tls="tcp"` host memory only
(`cuda_memory=False`); with `tls="all"` (or None: UCX's full list — cma,
cuda_copy, cuda_ipc, rc/dc where present) CUDA tensors register as VRAM,
once, on every agent, and descriptors say VRAM or DRAM from the region's
device (`nixl_wire.mem_type`), so VRAM→VRAM between processes on one GPU
goes over cuda_ipc — and `drop_peer` refuses, as above. `one_sided=False`,
honestly for tcp (the receiver's progress copies the bytes off the socket).
CUDA sources: UCX reads them itself, so a write stays in the progress
thread's post queue until the producer's `ready` event is reached (`_post`);
no thread blocks on it.
Deliberately absent: `read` (nothing needs it yet).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import uuid
from typing import Any

import numpy as np
import torch

from .base import Capabilities, LocalRegion, NotifyHandler, TransportEngine
from .errors import (
    CapabilityError,
    ClosedError,
    PeerLostError,
    RegistrationError,
    TransportError,
)
from .listener import DEFAULT_MAX_PENDING, Listener, Slot
from .nixl_conn import NixlConnection
from .nixl_peer import InboundPeer
from .nixl_progress import Progress
from .nixl_requests import Requests
from .nixl_wire import (  # the tls policy lives with make_agent, which applies it
    FENCEABLE_TLS,
    FULL_TLS,
    Welcome,
    check_tls,
    cuda_tls,
    interface_of,
    make_agent,
    translate,
)
from .peering import SocketPeers
from .regions import Region, RegionTable

log = logging.getLogger(__name__)

class NixlEngine(SocketPeers, TransportEngine):
    """A nixl transport engine: one initiating agent, a control listener, links both ways."""

    name = "nixl"
    IGNORED_OPTIONS = frozenset({"streams"})  # UCX decides its own lanes
    capabilities = Capabilities(
        cuda_memory=False, cuda_zero_copy=False, cross_process=True,
        one_sided=False, notify=True, read=False,
    )

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        tls = options.get("tls", "tcp")
        tls = FULL_TLS if tls is None else check_tls(tls)
        fenceable = tls in FENCEABLE_TLS
        return dataclasses.replace(cls.capabilities, cuda_memory=cuda_tls(tls),
                                   cuda_zero_copy=cuda_tls(tls), one_sided=not fenceable,
                                   fence=fenceable)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int | None = None,
        *,
        tls: str | None = "tcp",
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`host`/`port`: the control listener. `streams` is accepted like every backend's
        common option and unused: UCX decides its own lanes. `tls`: the UCX transports
        ("tcp", fenceable; "all" or None: UCX's full list, VRAM-capable, no fence).
        `connect_timeout` bounds our connects and every inbound handshake;
        `max_pending` caps inbound connections still in their handshake."""
        del streams
        self.engine_id = f"nixl-{uuid.uuid4().hex[:12]}"
        self.tls = FULL_TLS if tls is None else check_tls(tls)
        # Per instance: VRAM only with UCX's cuda transports (the class's are tcp's); a widened
        # tls is one-sided (cma, cuda_ipc, rc) and cannot be fenced.
        fenceable = self.tls in FENCEABLE_TLS
        self.capabilities = dataclasses.replace(
            type(self).capabilities, cuda_memory=cuda_tls(self.tls), cuda_zero_copy=cuda_tls(self.tls),
            one_sided=not fenceable, fence=fenceable)
        self.connect_timeout = connect_timeout
        self.regions = RegionTable(self.name, self.engine_id, cuda=self.capabilities.cuda_memory)
        self._lock = threading.Lock()  # engine state: regions, links, closed
        self._closed = False
        self._handler: NotifyHandler | None = None
        self._live: dict[int, Region] = {}
        self._retired: list[Region] = []  # deregistered, kept alive: see deregister()
        self._peers: set[InboundPeer] = set()
        self._serial = itertools.count(1)
        self._outbound: dict[str, NixlConnection] = {}
        self._agent_lock = threading.Lock()  # every NIXL call on the initiating agent
        # UCX listens on every interface it may use: keep it on the one `host` names
        self.device = interface_of(host)
        self._agent = make_agent(self.engine_id, self.tls, self.device)
        self._regs: dict[int, Any] = {}
        self.requests = Requests(self)  # queued by callers, posted and polled by Progress
        self._pending: set[InboundPeer] = set()  # accepted, handshake not done: close() fences them
        self._progress = Progress(self)
        try:
            self._listener = Listener(self.name, host, port, self._accepted,
                                      handshake_timeout=connect_timeout, max_pending=max_pending)
        except BaseException:
            self._progress.stop(2.0)
            raise
        self._host, self._port = self._listener.host, self._listener.port

    # -- memory -------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        with self._lock:
            self._check_open()
            region = self.regions.register(tensor)
            try:
                with self._agent_lock:
                    self._regs[region.region_id] = self._agent.register_memory(region.data)
                for peer in list(self._peers):
                    peer.add_region(region)
            except TransportError:
                self._undo(region)
                raise
            except Exception as exc:
                self._undo(region)
                raise translate(exc, f"registering {region.length} B with NIXL") from exc
            self._live[region.region_id] = region
        return region

    def _undo(self, region: Region) -> None:
        # Under the engine lock: no Gone frame (no peer heard of the region, and
        # a failed send would fence, which takes this lock again).
        self.regions.deregister(region)
        for peer in list(self._peers):
            peer.drop_region(region.region_id, tell=False)
        with self._agent_lock:
            reg = self._regs.pop(region.region_id, None)
            if reg is not None:
                self._agent.deregister_memory(reg)

    def deregister(self, region: LocalRegion) -> None:
        """Forget a region; its memory stays referenced until close.

        Over tcp a peer's write names raw addresses, and a write posted
        before the peer hears `Gone` may still land: keeping the tensor alive
        keeps that write from landing in freed memory.
        """
        self.regions.deregister(region)
        with self._lock:
            live = self._live.pop(getattr(region, "region_id", -1), None)
            if live is not region:
                if live is not None:
                    self._live[live.region_id] = live
                return
            self._retired.append(live)
            peers = list(self._peers)
            with self._agent_lock:
                reg = self._regs.pop(live.region_id, None)
                if reg is not None and self._agent is not None:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception:
                        log.exception("nixl: deregistering region %d failed", live.region_id)
        for peer in peers:
            peer.drop_region(live.region_id)

    def _live_regions(self) -> list[Region]:
        with self._lock:
            return list(self._live.values())

    # -- peers --------------------------------------------------------------
    def _new_connection(self, host: str, port: int, peer: str) -> NixlConnection:
        return NixlConnection(self, host, port, peer)

    def _load_metadata(self, metadata: bytes, expected: str) -> str:
        """Load a peer agent's metadata into our agent; its name must be `expected`."""
        with self._agent_lock:
            self._check_agent()
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise translate(exc, "loading the peer's NIXL metadata") from exc
        name = name.decode() if isinstance(name, bytes) else name
        if name != expected:
            raise RegistrationError(f"peer metadata is for agent {name!r}, expected {expected!r}")
        return name

    def has_peer(self, engine_id: str) -> bool:
        with self._lock:
            return any(p.sender == engine_id and not p.dead for p in self._peers | self._pending)

    def drop_peer(self, engine_id: str) -> None:
        if not self.capabilities.fence:
            raise CapabilityError(
                f"nixl engine with UCX transports {self.tls!r} cannot fence a peer: those "
                "transports write into our memory without our progress; use tls='tcp'"
            )
        with self._lock:
            peers = [p for p in self._peers if p.sender == engine_id]
        for peer in peers:
            peer.fence()

    # -- inbound links (called by InboundPeer) -------------------------------
    def _accepted(self, sock: socket.socket, where: str, slot: Slot) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = InboundPeer(self, sock, where, next(self._serial), slot)
        if self._track_accepted(self._pending, peer, sock, slot):
            peer.start()

    def _admit(self, peer: InboundPeer) -> Welcome:
        """Register every live region on a new link's agent and welcome it (or refuse: closed)."""
        with self._lock:
            if self._closed:
                raise PeerLostError(f"nixl engine {self.engine_id} is closing")
            welcome = peer.welcome(list(self._live.values()))
            self._peers.add(peer)
            self._pending.discard(peer)
        return welcome

    def _forget(self, peer: InboundPeer) -> None:
        with self._lock:
            self._peers.discard(peer)
            self._pending.discard(peer)

    def _live_peers(self) -> list[InboundPeer]:
        with self._lock:
            return [p for p in self._peers if not p.dead]

    # -- outbound transfers (called by NixlConnection and Progress) ----------
    def _post(self, conn: NixlConnection, seq: int, local: np.ndarray | None,
              remote: np.ndarray | None, note: bytes, mems: tuple[str, str] = ("DRAM", "DRAM"),
              ready: Any = None) -> None:
        """Queue one write (no descriptors: a notify alone) for the progress thread to post.

        The caller never takes the agent lock (why, and how a CUDA source's
        `ready` event is awaited without blocking: `nixl_requests`). A post
        NIXL refuses fails that write's handle, and the link when NIXL says
        it is broken (`NixlConnection.refused`).
        """
        self._check_agent()
        self.requests.queue(conn, seq, local, remote, note, mems, ready)
        self._progress.kick()

    def _disconnect(self, conn: NixlConnection) -> None:
        """A link is dead: cancel its requests and forget the peer's agent."""
        with self._agent_lock:
            if self._agent is None:
                return
            self.requests.drop(conn)
            try:
                self._agent.remove_remote_agent(conn.agent)
            except Exception as exc:
                log.debug("nixl: removing agent %s: %s", conn.agent, exc)
        with self._lock:
            if self._outbound.get(conn.peer) is conn:
                del self._outbound[conn.peer]

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"nixl engine {self.engine_id} is closed")

    def _check_agent(self) -> None:
        if self._agent is None:
            raise ClosedError(f"nixl engine {self.engine_id} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outbound = list(self._outbound.values())
            peers = list(self._peers) + list(self._pending)
        self._listener.close(2.0)
        for peer in peers:
            peer.fence()
        for conn in outbound:
            conn.close()
        self._progress.stop(2.0)
        for peer in peers:
            peer.join(2.0)
        with self._agent_lock:
            agent, self._agent = self._agent, None
            self.requests.release_all()
            for reg in self._regs.values():
                try:
                    agent.deregister_memory(reg)
                except Exception:
                    log.debug("nixl: deregistering at close failed")
            self._regs.clear()
            del agent  # last reference: the NIXL agent and its UCX worker go now
        self.regions.clear()
        self._live.clear()
        self._retired.clear()



class NixlFullEngine(NixlEngine):
    """The nixl backend with UCX's full transport list (`tls="all"`) by default.

    A registry entry of its own so the conformance suite and `pdxfer bench
    transport` run it beside nixl-over-tcp: cma on one host here, cuda_ipc
    and cuda_copy for VRAM on a GPU, rc/dc with a NIC. It cannot fence a
    peer (`drop_peer` raises `CapabilityError`). Same wire and descriptors
    as `nixl` (`name` stays "nixl"): the two interoperate.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, streams: int | None = None, *,
                 tls: str | None = FULL_TLS, connect_timeout: float = 10.0,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        super().__init__(host, port, streams, tls=tls, connect_timeout=connect_timeout,
                         max_pending=max_pending)
