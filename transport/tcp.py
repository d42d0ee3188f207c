"""The tcp backend: real sockets between any two hosts, no RDMA needed.

The engine owns a listener (127.0.0.1 unless told otherwise), the accept
thread, the inbound streams it spawns (`tcp_recv`), and one cached outbound
link per peer (`tcp_send`). Bytes go straight from registered source memory
into `sendmsg` and straight out of `recvmsg_into` into the destination slice;
the only copy is the pinned bounce that CUDA memory needs, because a socket
reads and writes host memory only.

Striping: a link is `streams` TCP connections to one peer (default: one per
core, 2..8, the rule NCCL and Mooncake use for sockets) because one stream is
bound to one core's worth of copying; a transfer's bytes are spread over them
and its notify follows all of them.

Threads block in `accept`, `recv` and `Condition.wait`; nothing polls. Close
shuts sockets down, which wakes every one of those.

Deliberately absent: `read` (pull), TLS and authentication — the data plane
trusts the network it is bound to, which is why it binds to loopback by
default; expose it on a cluster network only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import weakref

import torch

from .base import (
    Capabilities,
    LocalRegion,
    NotifyHandler,
    TransportEngine,
    forced_fence,
    refuse_fence,
)
from .errors import ClosedError, PeerLostError, ProtocolError, TransportError
from .listener import DEFAULT_MAX_PENDING, Listener, Slot
from .peering import SocketPeers
from .regions import RegionTable
from .tcp_io import Bounce
from .tcp_recv import MAX_STREAMS, InboundStream, LinkState
from .tcp_send import TcpConnection, tune

log = logging.getLogger(__name__)


def default_streams() -> int:
    """One stream per core, at least 2 and at most 8."""
    return min(8, max(2, os.cpu_count() or 2))


class TcpEngine(SocketPeers, TransportEngine):
    """A tcp transport engine: listener, inbound streams and outbound striped links."""

    name = "tcp"
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=False, cross_process=True,
        one_sided=False, notify=True, read=False,
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int | None = None,
        *,
        bounce_bytes: int = 8 << 20,
        force_bounce: bool = False,
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
        fence: bool = True,
    ) -> None:
        """`force_bounce` routes host memory through the bounce buffer too: it
        exists so the CUDA staging path is tested on machines without a GPU.
        `fence=False` makes `drop_peer` refuse and `capabilities.fence` False, so the
        engine's no-fence (quarantine) path is tested here (`base.forced_fence`).
        `connect_timeout` bounds our connects and every inbound handshake;
        `max_pending` caps inbound connections still in their handshake."""
        streams = default_streams() if streams is None else streams
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise TransportError(f"streams must be an int in 1..{MAX_STREAMS}, got {streams!r}")
        if bounce_bytes < 4096:
            raise TransportError(f"bounce_bytes must be at least 4096, got {bounce_bytes}")
        self.capabilities = forced_fence(type(self), fence)
        self.engine_id = f"tcp-{uuid.uuid4().hex[:12]}"
        self.streams = streams
        self.bounce_bytes = bounce_bytes
        self.force_bounce = force_bounce
        self.pinned = torch.cuda.is_available()
        # Every stream's bounce buffer, allocated up front once this engine
        # holds CUDA memory (or force_bounce): see `new_bounce`.
        self._bounces: weakref.WeakSet[Bounce] = weakref.WeakSet()
        self._bouncing = force_bounce
        self.connect_timeout = connect_timeout
        self.regions = RegionTable(self.name, self.engine_id, cuda=True)
        self._lock = threading.Lock()
        self._closed = False
        self._handler: NotifyHandler | None = None
        self._outbound: dict[str, TcpConnection] = {}
        self._inbound: set[InboundStream] = set()
        # Every stream whose thread may still run. A stream leaves `_inbound`
        # (routing) in its thread's last steps, before the thread has ended, so
        # close() joins these too; finished ones are pruned at each accept.
        self._started: set[InboundStream] = set()
        self._links: dict[str, LinkState] = {}
        self._listener = Listener(self.name, host, port, self._accepted,
                                  handshake_timeout=connect_timeout, max_pending=max_pending)
        self._host, self._port = self._listener.host, self._listener.port

    # -- memory -------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        self._check_open()
        region = self.regions.register(tensor)
        if region.device == "cuda":
            with self._lock:
                first, self._bouncing = not self._bouncing, True
                bounces = list(self._bounces) if first else []
            for bounce in bounces:  # pinned now, never inside a transfer or a landing lock
                bounce.allocate()
        return region

    def new_bounce(self) -> Bounce:
        """A stream's bounce buffer, already allocated if this engine holds CUDA memory.

        Called when a stream is made (connect, accept); `register` allocates
        the rest when the first CUDA region arrives. Host-only engines never
        pin a byte.
        """
        bounce = Bounce(self.bounce_bytes, self.pinned)
        with self._lock:
            self._bounces.add(bounce)
            now = self._bouncing
        if now:
            bounce.allocate()
        return bounce

    def deregister(self, region: LocalRegion) -> None:
        self.regions.deregister(region)

    # -- peers --------------------------------------------------------------
    def _new_connection(self, host: str, port: int, peer: str) -> TcpConnection:
        return TcpConnection(self, host, port, peer, self.streams)

    def drop_peer(self, engine_id: str) -> None:
        # Streams still in their handshake have no sender yet and have written
        # nothing; if they belong to engine_id they form a new connection.
        refuse_fence(self, "it was created with fence=False")
        with self._lock:
            streams = [s for s in self._inbound if s.sender == engine_id]
        for stream in streams:
            stream.fence()

    def has_peer(self, engine_id: str) -> bool:
        # A stream leaves `_inbound` only after it read its socket's EOF (or was
        # fenced): every byte the peer had sent is in our memory by then.
        with self._lock:
            return any(s.sender == engine_id for s in self._inbound)

    # -- inbound bookkeeping (called by InboundStream) ----------------------
    def _accepted(self, sock: socket.socket, peer: str, slot: Slot) -> None:
        tune(sock)
        stream = InboundStream(self, sock, peer, slot)
        if self._track_accepted(self._inbound, stream, sock, slot):
            with self._lock:
                self._started = {s for s in self._started if s.thread.is_alive()}
                self._started.add(stream)
            stream.start()

    def _attach(self, stream: InboundStream, link: str, streams: int) -> LinkState:
        with self._lock:
            if self._closed:
                raise PeerLostError(f"tcp engine {self.engine_id} is closing")
            state = self._links.get(link)
            if state is None:
                state = self._links[link] = LinkState(streams)
            if state.streams != streams:
                raise ProtocolError(f"link {link} announced {streams} streams after {state.streams}")
            state.refs += 1
            stream.link = link
            return state

    def _detach(self, stream: InboundStream) -> None:
        with self._lock:
            if stream not in self._inbound:
                return
            self._inbound.discard(stream)
            state = self._links.get(stream.link) if stream.link else None
            if state is not None:
                state.refs -= 1
                if state.refs == 0:
                    del self._links[stream.link]

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"tcp engine {self.engine_id} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outbound = list(self._outbound.values())
            inbound = list(self._inbound)
            started = list(self._started | self._inbound)
            self._outbound.clear()
        self._listener.close(2.0)
        for stream in inbound:
            stream.fence()
        for conn in outbound:
            conn.close()
        for stream in started:
            stream.join(2.0)
        self.regions.clear()
