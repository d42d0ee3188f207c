"""The sending side of one nixl link: the control socket, the peer's regions, posting writes.

A `NixlConnection` is made by `NixlEngine.connect`: it opens the control
connection, says `Hello`, and loads the `Welcome`'s NIXL metadata into the
engine's agent — the metadata of the agent the peer created for this link
alone (why: `nixl_peer.py`). The peer's regions arrive with it as
`(region, address, length)` rows: a write names a region by its descriptor
and the address comes from this table, so an edited descriptor cannot aim
NIXL at memory the peer never announced.

A write is one NIXL transfer: both descriptor lists built by array
arithmetic from the segment table (no loop per row), one `initialize_xfer`,
one `transfer`, its `Note` as the notification — made by the engine's
progress thread, to which `write` hands the descriptors (`NixlEngine._post`).
The handle completes when the peer's `Acks` name it — after its bytes landed and its notify ran — and
fails when the link dies (control socket closed: the peer died, closed or
fenced us) or NIXL reports the transfer broken.

A region registered by the peer after we connected is unknown here until a
`Refresh` round trip, which a write naming it triggers once.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import nixl_wire
from .base import Connection, LocalRegion, TransferHandle
from .control_link import ControlLink
from .copying import coalesce_posted
from .errors import PeerLostError, ProtocolError, RegistrationError, TransportError
from .handles import Handle
from .nixl_peer import gpu_of
from .nixl_wire import (
    CONTROL,
    Acks,
    Hello,
    Regions,
    Welcome,
    ints,
    mem_type,
    pack_note,
    recv_control,
)
from .regions import check_descriptor
from .segments import as_table, check_notify, check_table
from .streams import capture
from .wire import ErrorMessage

if TYPE_CHECKING:
    from .nixl import NixlEngine

log = logging.getLogger(__name__)


class NixlConnection(ControlLink, Connection):
    """A link to one peer engine: control socket, the peer's regions, transfers awaiting acks."""

    WIRE = nixl_wire

    def __init__(self, engine: NixlEngine, host: str, port: int, peer: str) -> None:
        self._engine = engine
        self.peer = peer
        self._lock = threading.Lock()
        self._pending: dict[int, Handle] = {}
        self._queries: dict[int, threading.Event] = {}
        self._error: TransportError | None = None
        self._seqs = itertools.count(1)
        self._qids = itertools.count(1)
        try:
            sock = socket.create_connection((host, port), timeout=engine.connect_timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to nixl engine {peer} at {host}:{port}: {exc}") from exc
        self._sock = sock
        try:
            CONTROL.send(sock, Hello(engine.engine_id))
            welcome = recv_control(sock)
            if isinstance(welcome, ErrorMessage):
                raise ProtocolError(f"nixl engine {peer} refused the link: {welcome.reason}")
            if not isinstance(welcome, Welcome):
                raise ProtocolError(f"expected welcome from {peer}, got {type(welcome).TYPE}")
            if welcome.engine != peer:
                raise RegistrationError(
                    f"{host}:{port} is nixl engine {welcome.engine}, not {peer}; the address is stale"
                )
            self.agent = engine._load_metadata(welcome.metadata, welcome.agent)
            self._regions = self._table(welcome.regions)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name=f"nixl-out {peer}", daemon=True)
        self._reader.start()

    @staticmethod
    def _table(data: bytes) -> dict[int, tuple[int, int, int]]:
        rows = ints(data, 4, "region list")
        return {int(r): (int(a), int(n), int(g)) for r, a, n, g in rows.tolist()}

    # -- writes ---------------------------------------------------------------
    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
        *,
        ready: Any = None,
    ) -> TransferHandle:
        if self._error is not None:
            raise self._error
        engine = self._engine
        src = engine.regions.local(local)
        region_id, length = check_descriptor(remote, "nixl", self.peer)
        base, dst_length, dst_gpu = self._resolve(region_id)
        if dst_length != length:
            raise RegistrationError(
                f"descriptor says region {region_id} has {length} B but it has {dst_length} B; "
                "the descriptor is stale or was edited"
            )
        table = as_table(segments)
        nbytes = check_table(table, src.length, dst_length)
        payload = check_notify(notify)
        # UCX reads the source itself: the post waits in the engine's queue for this event
        event = capture(ready, src.data.device)
        seq = next(self._seqs)
        handle = Handle(nbytes, f"nixl transfer {seq} to {self.peer}")
        with self._lock:
            if self._error is not None:
                raise self._error
            self._pending[seq] = handle  # before posting: the ack may beat us back
        try:
            if table.shape[0]:
                table = coalesce_posted(table)
                src_gpu = gpu_of(src)
                engine._post(self, seq, self._descs(src.start, table, 0, src_gpu),
                             self._descs(base, table, 1, dst_gpu), pack_note(seq, payload),
                             (mem_type(src_gpu), mem_type(dst_gpu)), event)
            else:
                engine._post(self, seq, None, None, pack_note(seq, payload))
        except BaseException:
            with self._lock:
                self._pending.pop(seq, None)
            raise
        return handle

    @staticmethod
    def _descs(base: int, table: np.ndarray, col: int, gpu: int) -> np.ndarray:
        """NIXL's `(address, length, device)` rows for one side of `table`, by array arithmetic."""
        out = np.zeros((table.shape[0], 3), dtype=np.uint64)
        out[:, 0] = table[:, col] + base
        out[:, 1] = table[:, 2]
        out[:, 2] = max(gpu, 0)  # host rows name device 0, as NIXL's own DRAM descriptors do
        return out

    # -- the control link's hooks (control_link.ControlLink) -------------------
    def _on_acks(self, msg: Acks) -> None:
        seqs = ints(msg.seqs, 1, "acks")[:, 0].tolist()
        with self._lock:
            handles = [self._pending.pop(s, None) for s in seqs]
        for handle in handles:
            if handle is not None:
                handle.complete()

    def _on_regions(self, msg: Regions) -> None:
        self.agent = self._engine._load_metadata(msg.metadata, self.agent)
        self._regions = self._table(msg.regions)

    def _release(self) -> None:
        pass  # the engine's `_disconnect` (ControlLink calls it next) forgets the peer's agent

    def refused(self, seq: int, error: TransportError) -> None:
        """NIXL would not post write `seq` (progress thread): it fails, and the link if broken."""
        if isinstance(error, PeerLostError):
            self.sever(error)
            return
        with self._lock:
            handle = self._pending.pop(seq, None)
        if handle is not None:
            handle.fail(error)
