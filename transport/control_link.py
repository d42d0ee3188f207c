"""The control channel a one-sided backend keeps beside its data path, written once.

A backend whose bytes move without the receiver's CPU (nixl, verbs) still
needs a small TCP conversation per link: the receiver announces its regions
(`Welcome`, and `Regions` in answer to a `Refresh` when a write names one we
do not know), says when one is `Gone`, acknowledges landed transfers
(`Acks`), and the sender says `Bye` before it closes. A closed control socket
is also how a dead peer is noticed at once. The shape of all that is the same
for every such backend; only the frame classes and what an ack or a region
table means differ.

`ControlLink` is that shape as a mixin for the sending side, parameterised by
`WIRE` (a module holding `CONTROL`, `Refresh`, `Regions`, `Gone`, `Bye`,
`Acks`) and three hooks: `_on_acks(msg)`, `_on_regions(msg)` (install the
new table) and `_release()` (free the data path's resources). `accept_loop`
is the receiving engine's listener loop; `ControlPeer` is the receiving
side's half (acks, and fencing a link whose sender is gone). Both `NixlConnection` and
`VerbsConnection` are built on it.
"""

from __future__ import annotations

import abc
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from .errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from .wire import ErrorMessage

log = logging.getLogger(__name__)
BYE_WAIT = 1.0  # how long close() waits for the peer to fence us and hang up


# The frames whose meaning is the same on every control channel; each backend's
# wire module lists them in its own versioned `Protocol` beside the frames that
# are its own (Hello, Welcome, Regions: what a link and a region table are).
@dataclass(frozen=True)
class Refresh:
    """A write named a region the sender does not know: send the current table."""

    TYPE: ClassVar[str] = "refresh"
    query: int


@dataclass(frozen=True)
class Acks:
    """These transfers' bytes are in the receiver's memory and their notify was delivered."""

    TYPE: ClassVar[str] = "acks"
    seqs: bytes  # little-endian int64 sequence numbers


@dataclass(frozen=True)
class Gone:
    """Region `region` was deregistered: stop addressing it."""

    TYPE: ClassVar[str] = "gone"
    region: int


@dataclass(frozen=True)
class Bye:
    """The sender closes the link; the receiver fences it and hangs up."""

    TYPE: ClassVar[str] = "bye"


class ControlLink(abc.ABC):
    """Mixin for an outbound link: region lookup/refresh, the control reader, sever and close.

    The class sets `WIRE`; the instance sets `_engine` (with `name`,
    `engine_id`, `connect_timeout`, `_disconnect`), `peer`, `_sock`, `_lock`,
    `_pending` (seq -> handle, or what `_drop_pending` turns into handles),
    `_queries`, `_qids`, `_error`, `_regions` and `_reader`.
    """

    WIRE: ModuleType

    @abc.abstractmethod
    def _on_acks(self, msg: Any) -> None:
        """Complete the transfers an `Acks` frame names."""

    @abc.abstractmethod
    def _on_regions(self, msg: Any) -> None:
        """Install the peer's fresh region table (answer to our `Refresh`)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the data path's resources as the link dies."""

    def _drop_pending(self, pending: list) -> list:
        """Under the lock, as the link dies: the handles among `_pending`'s values (a backend
        may store more beside them), after forgetting any work not yet posted."""
        return pending

    @property
    def alive(self) -> bool:
        return self._error is None

    @property
    def dead(self) -> bool:
        return self._error is not None

    def _resolve(self, region_id: int) -> tuple:
        """The peer's entry for `region_id`, refreshing the table once if we do not know it."""
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
        query, done = next(self._qids), threading.Event()
        with self._lock:
            if self._error is not None:
                raise self._error
            self._queries[query] = done
        try:
            self.WIRE.CONTROL.send(self._sock, self.WIRE.Refresh(query))
            if not done.wait(self._engine.connect_timeout):
                raise TransferTimeout(
                    f"{self._engine.name} engine {self.peer} did not answer a region refresh in "
                    f"{self._engine.connect_timeout} s; it is stalled — drop it or retry"
                )
        finally:
            with self._lock:
                self._queries.pop(query, None)
        if self._error is not None:
            raise self._error

    def _read(self) -> None:
        """The control reader thread: acks, region tables, hang-ups."""
        w, name = self.WIRE, self._engine.name
        try:
            while True:
                msg = w.CONTROL.recv(self._sock)
                if isinstance(msg, w.Acks):
                    self._on_acks(msg)
                elif isinstance(msg, w.Regions):
                    self._on_regions(msg)
                    with self._lock:
                        done = self._queries.get(msg.query)
                    if done is not None:
                        done.set()
                elif isinstance(msg, w.Gone):
                    self._regions = {k: v for k, v in self._regions.items() if k != msg.region}
                elif isinstance(msg, ErrorMessage):
                    raise ProtocolError(f"{name} engine {self.peer} hung up: {msg.reason}")
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from {name} engine {self.peer}")
        except PeerLostError as exc:
            self.sever(PeerLostError(
                f"{name} engine {self.peer} closed the link (it died, closed, or dropped us): {exc}"
            ))
        except TransportError as exc:
            self.sever(exc)

    def sever(self, error: TransportError) -> None:
        """Kill the link with `error`: pending transfers fail, resources go. Idempotent."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending, self._pending = self._drop_pending(list(self._pending.values())), {}
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
        self._release()
        self._engine._disconnect(self)

    def close(self) -> None:
        """Fail what is in flight with `ClosedError`; the peer fences the link before we let go."""
        if self._error is not None and not isinstance(self._error, ClosedError):
            return
        first = self._error is None
        self.sever(ClosedError(f"{self._engine.name} connection {self._engine.engine_id}->{self.peer} closed"))
        if not first:
            return
        try:  # the peer fences us on Bye and hangs up; its hang-up ends our reader
            self.WIRE.CONTROL.send(self._sock, self.WIRE.Bye())
        except TransportError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(BYE_WAIT)
        self._hang_up()


class ControlPeer:
    """Mixin for an inbound link: what the receiving side says back on the control socket.

    The class sets `WIRE` (as for `ControlLink`); the instance sets `engine`,
    `sock`, `send_lock`, `sender`, `dead` and `fence()`. A send that fails means the
    sender is gone: the link is fenced, never left half alive.
    """

    WIRE: ModuleType

    def ack(self, seqs: list[int]) -> None:
        """Tell the sender these transfers landed (after their notify was delivered)."""
        if seqs:
            self.send(self.WIRE.Acks(np.asarray(seqs, dtype="<i8").tobytes()))

    def send(self, msg: Any) -> None:
        if self.dead:
            return
        try:
            self._send(msg)
        except TransportError as exc:
            log.warning("%s: link from %s lost while sending %s: %s",
                        self.engine.name, self.sender, type(msg).TYPE, exc)
            self.fence()

    def _send(self, msg: Any) -> None:
        with self.send_lock:
            self.WIRE.CONTROL.send(self.sock, msg)


def accept_loop(engine: Any, listener: socket.socket, start: Callable[[socket.socket, str], None]) -> None:
    """Accept control connections until the engine closes; `start(sock, "host:port")` each."""
    while True:
        try:
            sock, addr = listener.accept()
        except OSError as exc:
            if engine._closed:
                return
            log.warning("%s engine %s: accept failed: %s", engine.name, engine.engine_id, exc)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start(sock, f"{addr[0]}:{addr[1]}")


def shut_listener(listener: socket.socket) -> None:
    """Close a listener so that a thread blocked in its accept() returns (Linux needs shutdown)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()
