"""The receiving side of one nixl link: a NIXL agent that serves exactly one sender.

Why an agent per inbound peer: over UCX's tcp transport the bytes of a write
land only when the *receiving* worker is progressed (its progress call reads
the socket into our memory). If every sender shared one receiving agent,
fencing one of them would mean stopping progress for all. With one agent
per link, the fence (`stop_path`) takes the agent's lock (so no progress
call is running), marks the link dead (so none starts again) and destroys
the agent (closing its sockets); after that nothing can write that peer's
bytes into our memory. That is the fence `drop_peer` promises, and it holds
because (a) the agent has no NIXL progress thread, (b) UCX is limited to tcp
(cma or RDMA would write into our memory with no action of ours at all),
and (c) the progress thread is the only caller of progressing NIXL calls on
it, always under `lock`. The kit (`transport.inbound`) then waits out a
notify being delivered, and no notify of the link starts afterwards.

Regions: every registered region is registered on this link's agent too
(a child of the region, keyed by this link: deregistering the region or
ending the link closes it). Memory: a write the sender posted before it
heard `Gone` may still land, by raw address; so the link holds every
region it ever announced until it ends, and only then lets the memory go
(`held`) — the link, not the engine, is what may still write there.

Cost: one UCX worker and one registration of every region per inbound
link — cheap on tcp (no pinning) and links are few (a decode node hears
from a handful of prefill nodes).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import pdxfer.transport.nixl.wire as nixl_wire  # absolute: `from . import` depends on nixl/__init__

from ..control import ControlInbound
from ..errors import PeerLostError, ProtocolError
from ..inbound import InboundTable
from ..listener import Slot
from ..regions import Region
from .agent import make_agent, translate
from .wire import Hello, Regions, Welcome, region_rows, unpack_note

log = logging.getLogger(__name__)


class _LinkRegistration:
    """A region's registration on one link's agent: a child of the region."""

    def __init__(self, peer: InboundPeer, region_id: int) -> None:
        self._peer, self._region_id = peer, region_id

    def close(self) -> None:
        self._peer.unregister(self._region_id)


class InboundPeer(ControlInbound):
    """One sender's link into this engine: its control socket, its serving agent, its fence."""

    WIRE = nixl_wire

    def __init__(self, table: InboundTable, sock: socket.socket, where: str, slot: Slot, *,
                 engine_id: str, serial: int, tls: str, device: str | None,
                 admit: Callable[[InboundPeer], list[Region]],
                 live: Callable[[], list[Region]]) -> None:
        super().__init__(table, sock, f"nixl link from {where}", slot)
        self._engine_id = engine_id
        self.serial = serial
        self._tls, self._device = tls, device
        self._admit = admit  # registers every live region on us, atomically with register()
        self._live = live
        self.agent: Any = None
        self.agent_name = ""
        self.lock = threading.Lock()  # held by every NIXL call on `agent`
        self._regs: dict[int, Any] = {}  # region id -> NIXL registration on `agent`
        self.held: dict[int, Region] = {}  # every region announced on this link, until it ends

    # -- setup (the control thread) ---------------------------------------------------
    def admit(self, hello: Hello) -> Welcome:
        self.agent_name = f"{self._engine_id}<{hello.engine}#{self.serial}"
        self.agent = make_agent(self.agent_name, self._tls, self._device)
        self.identify(hello.engine, f"{hello.engine}#{self.serial}")
        regions = self._admit(self)
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            metadata = self.agent.get_agent_metadata()
        return Welcome(self._engine_id, self.agent_name, metadata, region_rows(regions), self.incarnation)

    def regions_reply(self, query: int) -> Regions:
        regions = self._live()
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            metadata = self.agent.get_agent_metadata()
        return Regions(query, metadata, region_rows(regions))

    # -- regions ----------------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        """Register `region` on this link's agent (a child of the region; the NIXL error translated)."""
        with self.lock:
            if self.dead or region.region_id in self._regs:
                return
            try:
                self._regs[region.region_id] = self.agent.register_memory(region.data)
            except Exception as exc:
                raise translate(exc, f"registering region {region.region_id} for {self.sender}") from exc
            self.held[region.region_id] = region
        region.adopt(("nixl-link", self.serial), _LinkRegistration(self, region.region_id))

    def unregister(self, region_id: int) -> None:
        """Deregister a region from this link's agent (it keeps the memory held until it ends)."""
        with self.lock:
            reg = self._regs.pop(region_id, None)
            if reg is not None and not self.dead:
                try:
                    self.agent.deregister_memory(reg)
                except Exception:
                    log.exception("nixl: deregistering region %d failed", region_id)

    # -- the data path (the progress thread) -------------------------------------------------
    def poll(self) -> list[tuple[int, bytes | None]] | None:
        """Progress this link's agent once; `(seq, payload)` of the transfers that landed.

        None when the link is dead. Notifications from any agent but the
        sender's are refused (logged and dropped): nobody else knows this
        agent's name.
        """
        with self.lock:
            if self.dead or self.agent is None:
                return None
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as exc:
                log.warning("nixl: %s", translate(exc, f"progress of the link from {self.sender}"))
                notifs = None
        if notifs is None:
            self.fence()
            return None
        out: list[tuple[int, bytes | None]] = []
        for name, messages in notifs.items():
            for data in messages:
                try:
                    if name != self.sender:
                        raise ProtocolError(f"notification from {name!r} on the link of {self.sender!r}")
                    note = unpack_note(data)
                except ProtocolError as exc:
                    log.warning("nixl: dropped a notification: %s", exc)
                    continue
                out.append((note.seq, note.payload))
        return out

    # -- the fence's core -----------------------------------------------------------------------
    def stop_path(self) -> None:
        """Destroy the agent under its lock: no progress call runs now, and none can later."""
        with self.lock:
            agent, self.agent = self.agent, None
            regs, self._regs = list(self._regs.values()), {}
            if agent is not None:
                for reg in regs:
                    try:
                        agent.deregister_memory(reg)
                    except Exception:
                        log.exception("nixl: deregistering during a fence failed")
                del agent  # the last reference: the C++ agent and its UCX worker go now
            # nothing of this link can land any more: the memory is free to go
            held, self.held = list(self.held.values()), {}
        for region in held:  # their registrations on our agent went with it: forget them
            region.drop(("nixl-link", self.serial))
