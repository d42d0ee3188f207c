"""The tcp engine: real sockets between any two hosts, no RDMA needed.

On the kit (`transport.engine.EngineBase`), what is tcp's: the listener's
connections become `recv.InboundStream`s, outbound links are
`send.TcpLink`s of `streams` sockets each, and the engine's one bounded
`bounce.BouncePool` (every stream of every link leases its slots) is pinned
once it holds CUDA memory. Bytes go straight from
registered source memory into `sendmsg` and straight out of `recvmsg_into`
into the destination slice; the only copy is the pinned bounce that CUDA
memory needs, because a socket reads and writes host memory only.

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
from typing import Any

from ..base import Capabilities
from ..dial import tune
from ..engine import EngineBase
from ..errors import CapabilityError
from ..link import Link
from ..listener import DEFAULT_MAX_PENDING, Slot
from ..regions import Region
from .bounce import DEFAULT_POOL_BYTES, BouncePool
from .recv import MAX_STREAMS, InboundStream, Links
from .send import TcpLink

log = logging.getLogger(__name__)


def default_streams() -> int:
    """One stream per core, at least 2 and at most 8."""
    return min(8, max(2, os.cpu_count() or 2))


class TcpEngine(EngineBase):
    """A tcp transport engine: listener, inbound streams and outbound striped links."""

    name = "tcp"
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=False, cross_process=True,
        one_sided=False, notify=True, read=False,
    )
    FENCE_OPTION = True

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int | None = None,
        bounce_bytes: int = 8 << 20,
        bounce_pool_bytes: int = DEFAULT_POOL_BYTES,
        force_bounce: bool = False,
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
        fence: bool = True,
    ) -> None:
        """`streams`: TCP connections per link (1..64; default one per core, 2..8).
        `bounce_bytes`: one bounce slot (a batch of CUDA bytes through host memory);
        `bounce_pool_bytes`: all of this engine's bounce slots, every link's together
        (at least 2 x `bounce_bytes`; pinned once CUDA memory is registered).
        `force_bounce` routes host memory through the bounce pool too: it exists so
        the CUDA staging path is tested on machines without a GPU. `fence=False` makes
        `drop_peer` refuse and `capabilities.fence` False, so the engine's no-fence
        (quarantine) path is tested here. `connect_timeout` bounds a whole dial and
        every inbound handshake; `max_pending` caps inbound connections still in their
        handshake."""
        streams = default_streams() if streams is None else streams
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise CapabilityError(f"streams must be an int in 1..{MAX_STREAMS}, got {streams!r}")
        if isinstance(bounce_bytes, bool) or not isinstance(bounce_bytes, int) or bounce_bytes < 4096:
            raise CapabilityError(f"bounce_bytes must be an int of at least 4096, got {bounce_bytes!r}")
        if (isinstance(bounce_pool_bytes, bool) or not isinstance(bounce_pool_bytes, int)
                or bounce_pool_bytes < 2 * bounce_bytes):
            raise CapabilityError(
                f"bounce_pool_bytes must be an int of at least 2 x bounce_bytes "
                f"({2 * bounce_bytes}), got {bounce_pool_bytes!r}")
        super().__init__(connect_timeout=connect_timeout, options={"fence": fence})
        self.streams = streams
        self.bounces = BouncePool(bounce_bytes, bounce_pool_bytes, force=bool(force_bounce),
                                  timeout=self.connect_timeout, scratches=self.scratches)
        self._links = Links()
        self.listen(host, port, max_pending)

    def backend_usage(self) -> dict[str, int]:
        return {"bounce_bytes": self.bounces.allocated_bytes, "bounce_pinned": int(self.bounces.pinned)}

    def on_register(self, region: Region) -> None:
        if region.device == "cuda":
            self.bounces.activate()  # pinned now, never inside a transfer or a landing

    def open_link(self, address: dict[str, Any]) -> Link:
        return TcpLink(self.link_context(), self.dials, address, self.streams, self.bounces)

    def accept(self, sock: socket.socket, where: str, slot: Slot) -> None:
        tune(sock)
        stream = InboundStream(self.inbound, sock, where, slot, engine_id=self.engine_id,
                               regions=self.regions, links=self._links, bounces=self.bounces)
        if not (self.inbound.track(stream) and stream.start(stream.run, f"tcp-recv {where}")):
            slot.admitted()  # closing: nothing more is served
            sock.close()
