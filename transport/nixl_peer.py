"""The receiving side of one nixl link: a NIXL agent that serves exactly one sender.

Why an agent per inbound peer: over UCX's tcp transport the bytes of a write
land only when the *receiving* worker is progressed (its progress call reads
the socket into our memory). If every sender shared one receiving agent,
fencing one of them would mean stopping progress for all. With one agent
per link, `fence()` takes the agent's lock (so no progress call is running),
marks it dead (so none starts again) and destroys it (closing its sockets);
after that nothing can write that peer's bytes into our memory. That is the
fence `drop_peer` promises, and it holds because (a) the agent has no NIXL
progress thread, (b) UCX is limited to tcp (cma or RDMA would write into our
memory with no action of ours at all), and (c) our progress thread is the
only caller of progressing NIXL calls on it, always under `lock`.

Cost: one UCX worker and one registration of every region per inbound
link — cheap on tcp (no pinning) and links are few (a decode node hears
from a handful of prefill nodes).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np

from . import nixl_wire
from .control_link import ControlPeer
from .errors import PeerLostError, ProtocolError, TransportError
from .listener import Slot
from .nixl_wire import (
    Bye,
    Gone,
    Hello,
    Refresh,
    Regions,
    Welcome,
    make_agent,
    recv_control,
    translate,
    unpack_note,
)
from .regions import Region
from .wire import HANDSHAKE_MAX_FRAME

if TYPE_CHECKING:
    from .nixl import NixlEngine

log = logging.getLogger(__name__)

# A stalled sender that stops reading its control socket must not stall our
# progress thread forever in a send of acks.
SEND_TIMEOUT = 5.0


def region_rows(regions: list[Region]) -> bytes:
    """`(region_id, address, length, gpu)` rows as raw little-endian int64 bytes (gpu -1: host)."""
    rows = np.array([[r.region_id, r.start, r.length, gpu_of(r)] for r in regions],
                    dtype="<i8").reshape(-1, 4)
    return rows.tobytes()


def gpu_of(region: Region) -> int:
    """The CUDA device index of a region, -1 for host memory: what NIXL's VRAM descriptors name."""
    return -1 if region.device != "cuda" else int(region.data.device.index or 0)


class InboundPeer(ControlPeer):
    """One sender's link into this engine: its control socket, its serving agent, its fence."""

    WIRE = nixl_wire

    def __init__(self, engine: NixlEngine, sock: socket.socket, where: str, serial: int,
                 slot: Slot) -> None:
        self.engine = engine
        self.sock = sock
        self.slot = slot  # our place in the listener's pre-handshake budget
        self.where = where
        self.serial = serial
        self.sender: str | None = None
        self.agent = None
        self.agent_name = ""
        self.lock = threading.Lock()  # held by every NIXL call on `agent`
        self.send_lock = threading.Lock()
        # held while the progress thread hands this link's notifies to the handler
        self.delivering = threading.RLock()
        self.dead = False
        self._regs: dict[int, object] = {}  # region id -> NIXL registration on `agent`
        self._thread = threading.Thread(target=self._serve, name=f"nixl-in {where}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the link's reader thread: close() joins what the engine started."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- setup --------------------------------------------------------------
    def _serve(self) -> None:
        try:
            # the listener set the handshake timeout; until Welcome, frames are capped small
            hello = recv_control(self.sock, HANDSHAKE_MAX_FRAME)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {type(hello).TYPE}")
            self.sender = hello.engine
            self.agent_name = f"{self.engine.engine_id}<{hello.engine}#{self.serial}"
            self.agent = make_agent(self.agent_name, self.engine.tls, self.engine.device)
            welcome = self.engine._admit(self)  # registers every region under the engine lock
            # The reader blocks until the peer talks or hangs up; sends (acks,
            # from the progress thread) give up after SEND_TIMEOUT instead.
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                 struct.pack("ll", int(SEND_TIMEOUT), 0))
            self._send(welcome)
            self.slot.admitted()
            while not self.dead:
                msg = recv_control(self.sock)
                if isinstance(msg, Refresh):
                    self._send(self._regions_reply(msg.query))
                elif isinstance(msg, Bye):
                    break
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from sender {self.sender}")
        except (TransportError, OSError) as exc:
            if not self.dead and not isinstance(exc, PeerLostError):
                log.warning("nixl link from %s (%s) dropped: %s", self.sender, self.where, exc)
        except Exception:  # a NIXL failure while admitting: the link is unusable
            log.exception("nixl link from %s (%s) failed", self.sender, self.where)
        self.slot.admitted()
        self.fence()

    def welcome(self, regions: list[Region]) -> Welcome:
        """Register `regions` on the serving agent and describe them (called by the engine)."""
        for region in regions:
            self.add_region(region)
        with self.lock:
            metadata = self.agent.get_agent_metadata()
        return Welcome(self.engine.engine_id, self.agent_name, metadata, region_rows(regions))

    def _regions_reply(self, query: int) -> Regions:
        regions = self.engine._live_regions()
        with self.lock:
            if self.dead:
                raise PeerLostError("link fenced")
            metadata = self.agent.get_agent_metadata()
        return Regions(query, metadata, region_rows(regions))

    # -- regions ------------------------------------------------------------
    def add_region(self, region: Region) -> None:
        """Register `region` on this link's agent (raises the translated NIXL error)."""
        with self.lock:
            if self.dead or region.region_id in self._regs:
                return
            try:
                self._regs[region.region_id] = self.agent.register_memory(region.data)
            except Exception as exc:
                raise translate(exc, f"registering region {region.region_id} for {self.sender}") from exc

    def drop_region(self, region_id: int, *, tell: bool = True) -> None:
        """Deregister a region from this link's agent and (if `tell`) tell the sender it is gone."""
        with self.lock:
            reg = self._regs.pop(region_id, None)
            if reg is not None and not self.dead:
                try:
                    self.agent.deregister_memory(reg)
                except Exception:
                    log.exception("nixl: deregistering region %d failed", region_id)
        if reg is not None and tell:
            self.send(Gone(region_id))

    # -- data path (called by the progress thread) ---------------------------
    def poll(self) -> list[tuple[int, bytes | None]] | None:
        """Progress this link's agent once; `(seq, payload)` of the transfers that landed.

        None when the link is dead. Notifications from any agent but the
        sender's are refused (logged and dropped): nobody else knows this
        agent's name.
        """
        with self.lock:
            if self.dead:
                return None
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as exc:
                error = translate(exc, f"progress of the link from {self.sender}")
                log.warning("nixl: %s", error)
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

    # -- the fence ----------------------------------------------------------
    def fence(self) -> None:
        """Stop this link for good: after return, none of its sender's bytes lands. Idempotent.

        Taking `lock` waits out a progress call in flight; `dead` keeps any
        later one from starting; destroying the agent closes its UCX
        sockets, so the sender sees the link fail too. Taking `delivering`
        waits out a notify of this link being handed to the handler.
        """
        with self.lock:
            already, self.dead = self.dead, True
            agent, self.agent = self.agent, None
            regs, self._regs = list(self._regs.values()), {}
            if agent is not None:
                for reg in regs:
                    try:
                        agent.deregister_memory(reg)
                    except Exception:
                        log.exception("nixl: deregistering during a fence failed")
                del agent  # the last reference: the C++ agent and its UCX worker go now
        # every caller waits out a notify being delivered, even a second one; none starts later
        with self.delivering:
            pass
        if already:
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.engine._forget(self)
