"""Peers reached by host and port: address, one cached link per peer, notify delivery.

The tcp and nixl backends both listen on a socket, advertise
`{backend, engine, host, port}`, keep one outbound link per peer engine
(reusing it while alive, replacing it when dead, never keeping two when two
threads connect at once), and hand notify payloads to the caller's handler
without letting the handler's bugs kill a link. That is one mechanism, so it
is written once, here, as a mixin; a backend supplies only how to open its
own kind of connection (`_new_connection`).

The mixin reads the engine's `_lock`, `_closed`, `_outbound`, `_handler`,
`_host` and `_port`, which each backend sets in its constructor.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from .base import Connection, NotifyHandler
from .errors import ClosedError, RegistrationError

log = logging.getLogger(__name__)


class SocketPeers(abc.ABC):
    """Mixin for `TransportEngine`s whose peers are addressed by host and port."""

    @abc.abstractmethod
    def _new_connection(self, host: str, port: int, peer: str) -> Any:
        """Open this backend's connection to engine `peer` at `host:port` (may block)."""

    def address(self) -> dict[str, Any]:
        return {"backend": self.name, "engine": self.engine_id, "host": self._host, "port": self._port}

    def connect(self, peer_address: dict[str, Any]) -> Connection:
        self._check_open()
        addr = peer_address if isinstance(peer_address, dict) else {}
        host, port, peer = addr.get("host"), addr.get("port"), addr.get("engine")
        if (addr.get("backend") != self.name or not isinstance(host, str)
                or not isinstance(peer, str) or isinstance(port, bool) or not isinstance(port, int)):
            raise RegistrationError(
                f"not a {self.name} address: {peer_address!r}; pass the peer engine's address() "
                "(backend, engine, host, port)"
            )
        with self._lock:
            conn = self._outbound.get(peer)
            if conn is not None and conn.alive:
                return conn
        if conn is not None:
            conn.close()  # a dead link: release its sockets and threads
        # Opened without the lock: connecting blocks, and the lock guards the table only.
        fresh = self._new_connection(host, port, peer)
        spare = None
        with self._lock:
            closed = self._closed
            current = self._outbound.get(peer)
            if not closed and current is not None and current.alive and current is not conn:
                fresh, spare = current, fresh  # another thread connected meanwhile: keep one
            elif not closed:
                self._outbound[peer] = fresh
        if closed:
            fresh.close()
            raise ClosedError(f"{self.name} engine {self.engine_id} closed while connecting")
        if spare is not None:
            spare.close()
        return fresh

    def _track_accepted(self, table: set[Any], item: Any, sock: Any, slot: Any) -> bool:
        """Track a just-accepted connection in `table` so close() reaches it before its handshake.

        False (the socket closed, its listener slot freed) when the engine is closing.
        """
        with self._lock:
            if self._closed:
                slot.admitted()
                sock.close()
                return False
            table.add(item)
        return True

    def set_notify_handler(self, handler: NotifyHandler | None) -> None:
        self._handler = handler

    def _deliver(self, sender: str | None, payload: bytes) -> None:
        handler = self._handler
        if handler is None or self._closed or sender is None:
            return
        try:
            handler(sender, payload)
        except Exception:  # the handler is the caller's code; its bug must not kill the link
            log.exception("notify handler raised for a payload from %s", sender)
