"""The nixl engine on the kit: one initiating agent, a control listener, links both ways, one progress thread.

What NIXL brings: registered memory described once, and one posted request
moving a whole list of `(address, length)` pairs with a notification that
lands after the data. What the kit brings is the rest of the contract
(`transport.engine`, `transport.link`, `transport.control`); what is left
here is nixl's: the `agent.Initiator` that registers every region and
initiates every write, the inbound links (`inbound.InboundPeer`, each with
an agent serving that one sender), the outbound links (`send.NixlLink`), the
request queue (`requests.Requests`) and the one polling loop
(`progress.Progress`).

The fence, and the trade-off it costs. `drop_peer` must guarantee that no
byte of the dropped peer's earlier writes lands after it returns. With UCX's
shared-memory or RDMA transports (cma, knem, rc) a writer moves bytes into
our memory with no action of ours, and nothing on our side can stop a write
already under way, so `tls="tcp"` (the default) restricts UCX to its tcp
transport — passed to the UCX backend as its `engine_config`, never through
the environment — and NIXL runs without its own progress thread. Then bytes
land only inside our progress thread's calls on the link's own agent, and
the fence is: lock the link's agent, mark it dead, destroy it. The price is
the tcp transport's speed on one host and a UCX worker per inbound link.

Capabilities, per instance, from `tls` alone (`capabilities_for`, which the
registry's `nixl-all` = `tls="all"` answers with too): `tls="tcp"` — host
memory only, receiver-driven, fenceable; `tls="all"` (or None) — CUDA
tensors register as VRAM, descriptors say VRAM or DRAM per region,
one-sided (cma, cuda_ipc, rc), and `drop_peer` refuses. Without a fence the
initiating agent also serves every inbound link (`shared`), so a region is
registered once per engine however many peers write to it (#23). CUDA sources: UCX
reads them itself, so a write waits in the kit's post queue until the
producer's `ready` event is reached; no thread blocks on it.
Deliberately absent: `read` (nothing needs it yet).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
from collections.abc import Mapping
from typing import Any

from ..base import Capabilities
from ..control import LinkRegions
from ..engine import EngineBase
from ..link import Link
from ..listener import DEFAULT_MAX_PENDING, Slot
from ..regions import Region
from .agent import FENCEABLE_TLS, FULL_TLS, Initiator, check_tls, cuda_tls, interface_of
from .inbound import InboundPeer
from .progress import Progress
from .requests import Requests
from .send import NixlLink

log = logging.getLogger(__name__)


class NixlEngine(EngineBase):
    """A nixl transport engine: one initiating agent, a control listener, links both ways."""

    name = "nixl"
    capabilities = Capabilities(
        cuda_memory=False, cuda_zero_copy=False, cross_process=True,
        one_sided=False, notify=True, read=False,
    )

    @classmethod
    def capabilities_for(cls, options: Mapping[str, Any]) -> Capabilities:
        tls = options.get("tls", "tcp")
        tls = FULL_TLS if tls is None else check_tls(tls)
        fenceable = tls in FENCEABLE_TLS
        return dataclasses.replace(cls.capabilities, cuda_memory=cuda_tls(tls),
                                   cuda_zero_copy=cuda_tls(tls), one_sided=not fenceable,
                                   fence=fenceable)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: str | None = "tcp",
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`host`/`port`: the control listener. `tls`: the UCX transports ("tcp",
        fenceable; "all" or None: UCX's full list, VRAM-capable, no fence).
        `connect_timeout` bounds a whole dial and every inbound handshake;
        `max_pending` caps inbound connections still in their handshake."""
        super().__init__(connect_timeout=connect_timeout, options={"tls": tls})
        self.tls = FULL_TLS if tls is None else check_tls(tls)
        # UCX listens on every interface it may use: keep it on the one `host` names
        self.device = interface_of(host)
        self._shared = LinkRegions(self.regions, self.inbound, InboundPeer)  # every link gets every region
        self._serial = itertools.count(1)
        self._initiator = Initiator(self.engine_id, self.tls, self.device)
        # No fence possible (one-sided transports): the initiating agent serves every inbound
        # link too, so each region is registered once per engine (inbound.py).
        self._serving = None if self.capabilities.fence else self._initiator
        self._requests = Requests(self._initiator)
        self._progress = Progress(self.engine_id, self._requests, self._shared,
                                  shared=self._serving is not None,
                                  on_failure=self.progress_failed)
        try:
            self.listen(host, port, max_pending)
        except BaseException:
            self._progress.stop(2.0)
            self._initiator.close()
            raise

    def why_no_fence(self) -> str:
        return (f"its UCX transports {self.tls!r} write into our memory without our progress; "
                "use tls='tcp'")

    # -- memory -------------------------------------------------------------------------
    def on_register(self, region: Region) -> None:
        region.adopt("initiator", self._initiator.register(region))
        self._shared.registered(region)

    def on_deregister(self, region: Region) -> None:
        # Each link that announced it answers `GoneAck` (or is fenced) within connect_timeout:
        # then nothing of ours keeps the memory and nothing can land there (inbound.py).
        self._shared.deregistered(region, self.connect_timeout)

    # -- links ------------------------------------------------------------------------------
    def open_link(self, address: dict[str, Any]) -> Link:
        return NixlLink(self.link_context(), self.dials, address, self._initiator, self._requests,
                        self._progress.kick)

    def accept(self, sock: socket.socket, where: str, slot: Slot) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = InboundPeer(self.inbound, sock, where, slot, engine_id=self.engine_id,
                           serial=next(self._serial), tls=self.tls, device=self.device,
                           admit=self._shared.admit, live=self.regions.live, shared=self._serving,
                           on_progress_thread=self._progress.on_thread)
        if not (self.inbound.track(peer) and peer.start(peer.run, f"nixl-in {where}")):
            slot.admitted()  # closing: nothing more is served
            sock.close()

    def backend_usage(self) -> dict[str, int]:
        links = [p for p in self._shared.links() if p.shared is None]
        return {"registrations": self._initiator.registrations + sum(len(p.held) for p in links),
                "agents": 1 + len(links),
                "prepared_descriptors": self._initiator.prepared.descs}

    # -- lifecycle ------------------------------------------------------------------------------
    def release(self) -> bool:
        if not self._progress.stop(2.0):
            # The progress thread is still inside a NIXL call on these agents (a slow round on a
            # loaded host, or a stuck notify handler): destroying an agent under a running
            # `get_new_notifs` aborts the whole process (seen in the suite: "Fatal Python error:
            # Aborted" with close in `nixl_agent` teardown). Keep them; a later close() retries.
            log.warning("nixl engine %s: progress thread still running at close; its agents are "
                        "kept until it ends (close() again to retry)", self.engine_id)
            return False
        self._initiator.close(before=self._requests.release_all)
        return True
