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
one `transfer`, its `Note` as the notification. The handle completes when
the peer's `Acks` name it — after its bytes landed and its notify ran — and
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

from .base import Connection, LocalRegion, TransferHandle
from .copying import coalesce_posted
from .errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from .handles import Handle
from .nixl_wire import (
    CONTROL,
    Acks,
    Bye,
    Gone,
    Hello,
    Refresh,
    Regions,
    Welcome,
    ints,
    pack_note,
    recv_control,
)
from .regions import check_descriptor
from .segments import as_table, check_notify, check_table
from .wire import ErrorMessage

if TYPE_CHECKING:
    from .nixl import NixlEngine

log = logging.getLogger(__name__)

# How long close() waits for the peer to confirm it fenced this link.
BYE_WAIT = 1.0


class NixlConnection(Connection):
    """A link to one peer engine: control socket, the peer's regions, transfers awaiting acks."""

    def __init__(self, engine: NixlEngine, host: str, port: int, peer: str) -> None:
        self._engine = engine
        self.peer = peer
        self._lock = threading.Lock()
        self._pending: dict[int, Handle] = {}
        self._queries: dict[int, threading.Event] = {}
        self._error: TransportError | None = None
        self._seqs = itertools.count(1)
        self._ids = itertools.count(1)
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
    def _table(data: bytes) -> dict[int, tuple[int, int]]:
        rows = ints(data, 3, "region list")
        return {int(r): (int(a), int(n)) for r, a, n in rows.tolist()}

    @property
    def dead(self) -> bool:
        return self._error is not None

    @property
    def alive(self) -> bool:
        return self._error is None

    # -- writes ---------------------------------------------------------------
    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
    ) -> TransferHandle:
        if self._error is not None:
            raise self._error
        engine = self._engine
        src = engine.regions.local(local)
        region_id, length = check_descriptor(remote, "nixl", self.peer)
        base, dst_length = self._resolve(region_id)
        if dst_length != length:
            raise RegistrationError(
                f"descriptor says region {region_id} has {length} B but it has {dst_length} B; "
                "the descriptor is stale or was edited"
            )
        table = as_table(segments)
        nbytes = check_table(table, src.length, dst_length)
        payload = check_notify(notify)
        seq = next(self._seqs)
        handle = Handle(nbytes, f"nixl transfer {seq} to {self.peer}")
        with self._lock:
            if self._error is not None:
                raise self._error
            self._pending[seq] = handle  # before posting: the ack may beat us back
        try:
            if table.shape[0]:
                table = coalesce_posted(table)
                engine._post(self, self._descs(src.start, table, 0), self._descs(base, table, 1),
                             pack_note(seq, payload))
            else:
                engine._notify_only(self, pack_note(seq, payload))
        except BaseException:
            with self._lock:
                self._pending.pop(seq, None)
            raise
        return handle

    @staticmethod
    def _descs(base: int, table: np.ndarray, col: int) -> np.ndarray:
        """NIXL's `(address, length, device)` rows for one side of `table`, by array arithmetic."""
        out = np.zeros((table.shape[0], 3), dtype=np.uint64)
        out[:, 0] = table[:, col] + base
        out[:, 1] = table[:, 2]
        return out

    def _resolve(self, region_id: int) -> tuple[int, int]:
        """`(address, length)` of the peer's region, refreshing once if we do not know it."""
        found = self._regions.get(region_id)
        if found is None:
            self._refresh()
            found = self._regions.get(region_id)
        if found is None:
            raise RegistrationError(
                f"engine {self.peer} has no region {region_id} (never registered or deregistered); "
                "ask the peer for a fresh descriptor"
            )
        return found

    def _refresh(self) -> None:
        query = next(self._ids)
        done = threading.Event()
        with self._lock:
            if self._error is not None:
                raise self._error
            self._queries[query] = done
        try:
            CONTROL.send(self._sock, Refresh(query))
            if not done.wait(self._engine.connect_timeout):
                raise TransferTimeout(
                    f"nixl engine {self.peer} did not answer a region refresh in "
                    f"{self._engine.connect_timeout} s; it is stalled — drop it or retry"
                )
        finally:
            with self._lock:
                self._queries.pop(query, None)
        if self._error is not None:
            raise self._error

    # -- the control reader ---------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = recv_control(self._sock)
                if isinstance(msg, Acks):
                    self._acked(ints(msg.seqs, 1, "acks")[:, 0].tolist())
                elif isinstance(msg, Regions):
                    self.agent = self._engine._load_metadata(msg.metadata, self.agent)
                    self._regions = self._table(msg.regions)
                    with self._lock:
                        done = self._queries.get(msg.query)
                    if done is not None:
                        done.set()
                elif isinstance(msg, Gone):
                    self._regions = {k: v for k, v in self._regions.items() if k != msg.region}
                elif isinstance(msg, ErrorMessage):
                    raise ProtocolError(f"nixl engine {self.peer} hung up: {msg.reason}")
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from nixl engine {self.peer}")
        except PeerLostError as exc:
            self.sever(PeerLostError(
                f"nixl engine {self.peer} closed the link (it died, closed, or dropped us): {exc}"
            ))
        except TransportError as exc:
            self.sever(exc)

    def _acked(self, seqs: list[int]) -> None:
        with self._lock:
            handles = [self._pending.pop(s, None) for s in seqs]
        for handle in handles:
            if handle is not None:
                handle.complete()

    # -- teardown -------------------------------------------------------------
    def sever(self, error: TransportError) -> None:
        """Kill the link with `error`: pending transfers fail, NIXL forgets the peer. Idempotent."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending, self._pending = list(self._pending.values()), {}
            queries = list(self._queries.values())
        for handle in pending:
            handle.fail(error)
        for done in queries:
            done.set()
        if not isinstance(error, ClosedError):
            self._hang_up()

    def _hang_up(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._engine._disconnect(self)

    def close(self) -> None:
        """Fail what is in flight with `ClosedError`; the peer fences the link before we let go."""
        if self._error is not None and not isinstance(self._error, ClosedError):
            return
        first = self._error is None
        self.sever(ClosedError(f"nixl connection {self._engine.engine_id}->{self.peer} closed"))
        if not first:
            return
        try:  # the peer fences us on Bye and hangs up; its hang-up ends our reader
            CONTROL.send(self._sock, Bye())
        except TransportError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(BYE_WAIT)
        self._hang_up()
