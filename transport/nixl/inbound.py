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
heard `Gone` may still land, by raw address, even after the registration
is gone; so the link holds every region it announced (`held`) until it
knows none can. Deregistering a region (#19) tells every link `Gone`
(`region_gone`) and then waits, with no lock held and all links under one
deadline of the engine's `connect_timeout` (`gone_settled`), for each
sender's `GoneAck` — its word that every write it posted naming the region
has ended and none will follow (`send.py`). Acknowledged, the link lets the
region go. Not acknowledged in time (a stalled or broken sender), the link
is fenced — its agent destroyed, so nothing of it can land — and lets every
region go. The link ending meanwhile lets them go too (`stop_path`). Only
then does `deregister` return: nothing of the engine keeps the memory, and
nothing can write into it. Called on the progress thread (from a notify
handler), the wait would hold up the very progress it waits for (over tcp
the sender's bytes land only inside our progress calls): there it is not
waited for, and the link is fenced at once.

Cost: one UCX worker and one registration of every region per inbound
link — cheap on tcp (UCX's tcp transport pins nothing) — and one
`get_new_notifs` per link per progress round.

Without a fence (`tls="all"`: cma, cuda_ipc and RDMA write with no action
of ours, so no agent of ours could stop them) an agent per link buys
nothing and would register every region — VRAM included — again per link.
There every link is served by the engine's one initiating agent (`shared`):
regions are registered once per engine, a sender loads that one agent, and
the progress thread polls it once per round for every link's notifications
and hands each link its own (`landed`). Deregistration waits for the
`GoneAck` the same way; but a link that does not answer in time cannot be
fenced (its cma/cuda_ipc writes need no progress of ours), so it keeps that
region — logged as a warning — until it ends, as every region was kept
before #19: by its `Bye(quiet)` or its sender's death (settled), or
unproven, which `settled()` reports (docs/reliability.md, "What ends a
no-fence quarantine"). `deregister` returns after the bound either way.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pdxfer.transport.nixl.wire as nixl_wire  # absolute: `from . import` depends on nixl/__init__

from ..control import ControlInbound
from ..errors import PeerLostError, ProtocolError
from ..inbound import InboundTable
from ..listener import Slot
from ..regions import Region
from .agent import Initiator, make_agent, translate
from .wire import Gone, GoneAck, Hello, Regions, Welcome, region_rows, unpack_note

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
                 live: Callable[[], list[Region]], shared: Initiator | None = None,
                 on_progress_thread: Callable[[], bool] = lambda: False) -> None:
        """`shared`: the engine's initiating agent, serving this link too (no fence: tls="all");
        `on_progress_thread()`: whether the caller is the engine's progress thread."""
        super().__init__(table, sock, f"nixl link from {where}", slot)
        self.shared = shared
        self._engine_id = engine_id
        self.serial = serial
        self._tls, self._device = tls, device
        self._admit = admit  # registers every live region on us, atomically with register()
        self._live = live
        self.agent: Any = None
        self.agent_name = ""
        self.lock = threading.Lock()  # held by every NIXL call on `agent`
        self._regs: dict[int, Any] = {}  # region id -> NIXL registration on `agent`
        self.held: dict[int, Region] = {}  # regions announced on this link, until it lets them go
        self._due: dict[int, threading.Event] = {}  # region id -> set by its GoneAck (or the stop)
        self._stopped = False  # `stop_path` ran: nothing of this link can land, nothing is held
        self.on_progress_thread = on_progress_thread

    # -- setup (the control thread) ---------------------------------------------------
    def admit(self, hello: Hello) -> Welcome:
        if self.shared is not None:
            self.agent_name = self.shared.name
        else:
            self.agent_name = f"{self._engine_id}<{hello.engine}#{self.serial}"
            self.agent = make_agent(self.agent_name, self._tls, self._device)
        self.identify(hello.engine, f"{hello.engine}#{self.serial}")
        regions = self._admit(self)
        return Welcome(self._engine_id, self.agent_name, self._metadata(), region_rows(regions),
                       self.incarnation)

    def regions_reply(self, query: int) -> Regions:
        regions = self._live()
        return Regions(query, self._metadata(), region_rows(regions))

    def _metadata(self) -> bytes:
        if self.shared is not None:
            return self.shared.metadata()
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            return self.agent.get_agent_metadata()

    # -- regions ----------------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        """Register `region` on this link's agent (a child of the region; the NIXL error translated)."""
        with self.lock:
            if self.dead or region.region_id in self.held:
                return
            self.held[region.region_id] = region
            if self.shared is not None:
                return  # registered once, on the engine's agent
            try:
                self._regs[region.region_id] = self.agent.register_memory(region.data)
            except Exception as exc:
                del self.held[region.region_id]
                raise translate(exc, f"registering region {region.region_id} for {self.sender}") from exc
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

    def region_gone(self, region_id: int) -> None:
        """Tell the sender `Gone`; if we hold the region, expect its `GoneAck` (`gone_settled`)."""
        with self.lock:
            if region_id in self.held and not self._stopped:
                self._due[region_id] = threading.Event()  # before the Gone: the ack may race it
        self.send(Gone(region_id))

    def gone_settled(self, region_id: int, deadline: float) -> None:
        """Let the region go once its `GoneAck` came (by `deadline`), else fence the link (module docstring)."""
        with self.lock:
            due = self._due.get(region_id)
        if due is None:
            return  # never held, or the link already stopped: nothing is kept
        wait = 0.0 if self.on_progress_thread() else deadline - time.monotonic()
        acked = due.wait(max(0.0, wait))
        with self.lock:
            self._due.pop(region_id, None)
            if acked or self._stopped:
                self.held.pop(region_id, None)
                return
        if self.shared is not None:
            log.warning("nixl: %s did not acknowledge that region %d is gone within the bound; this "
                        "link cannot be fenced (tls=%r), so it keeps the region until it ends",
                        self.sender, region_id, self._tls)
            return
        log.warning("nixl: %s did not acknowledge that region %d is gone %s; fencing its link",
                    self.sender, region_id,
                    "(deregistered on the progress thread)" if wait <= 0 else "within the bound")
        self.fence()  # `stop_path` lets every region of the link go

    def on_frame(self, msg: object) -> bool:
        """`GoneAck`: the region it names may go (an ack nobody waits for is dropped)."""
        if not isinstance(msg, GoneAck):
            return False
        with self.lock:
            due = self._due.get(msg.region)
        if due is not None:
            due.set()
        return True

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
        return self.landed(notifs) if notifs else []

    def landed(self, notifs: dict[str, list[bytes]]) -> list[tuple[int, bytes | None]]:
        """`(seq, payload)` of the notifications in `notifs` (by agent name) that are this link's sender's.

        Others are refused (logged and dropped): nobody else knows this link.
        """
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
            self._stopped = True
            due, self._due = list(self._due.values()), {}
        for event in due:  # a deregistration waiting for an ack: nothing is kept now
            event.set()
        for region in held:  # their registrations on our agent went with it: forget them
            region.drop(("nixl-link", self.serial))
