"""The example's own control plane: client -> decode worker -> prefill worker.

Three small request/reply exchanges, each a typed, versioned msgpack frame of
`transport.wire.Protocol` (never pickle):

- `Hello` -> `HelloReply`: who a worker is, which model it serves (the weights
  digest, so two machines with different models refuse each other up front)
  and, for a prefill worker, its pdxfer bootstrap address.
- `Generate` -> `GenerateDone | Failed`: client to decode worker, one request
  (with the pool-boundary moves both workers made during it, `--resize-every`).
  `RoutedGenerate` is the same from the cluster example's router, naming the
  prefill instance (looked up in the peer directory) that serves it.
- `Prefill` -> `PrefillDone | Failed`: decode worker to prefill worker, carrying
  the destination entries so the prefill side can count what a layer-major
  pool would have posted for the same transfer.

The bytes of the caches never travel here; pdxfer moves them. `RpcServer` is a
thread-per-connection accept loop, `RpcClient` a blocking socket with a
timeout on every receive, so a dead or silent peer surfaces as
`PeerLostError` / `TransferTimeout` instead of a hang.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pdxfer.transport.errors import PeerLostError, ProtocolError, TransferTimeout
from pdxfer.transport.wire import ErrorMessage, Protocol


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True)
class HelloReply:
    TYPE: ClassVar[str] = "hello_reply"
    role: str
    model_digest: str
    transport: str
    device: str
    bootstrap: str  # "" for a decode worker


@dataclass(frozen=True)
class Generate:
    TYPE: ClassVar[str] = "generate"
    request_id: str
    prompt: list
    gen_len: int


@dataclass(frozen=True)
class RoutedGenerate:
    """A router's `Generate`: served from the prefill instance it picked in the peer directory."""

    TYPE: ClassVar[str] = "routed_generate"
    request_id: str
    prompt: list
    gen_len: int
    prefill: str  # the instance name; the decode worker resolves it in its directory


@dataclass(frozen=True)
class TransferFigures:
    """What one request's cache transfer cost, as the sending engine counted it.

    Not a message of its own: it rides inside `PrefillDone`/`GenerateDone` as a
    dict, converted by `figures_to_wire`/`figures_from_wire`.
    """

    nbytes: int
    segments: int
    layer_major_segments: int
    transfer_s: float


@dataclass(frozen=True)
class GenerateDone:
    TYPE: ClassVar[str] = "generate_done"
    request_id: str
    tokens: list
    transfer: dict  # TransferFigures fields
    resizes: list  # elastic.ResizeFigures fields, per boundary move during the request (v2)


@dataclass(frozen=True)
class Prefill:
    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt: list
    dst_indices: dict  # pool -> list of decode-side entries
    dst_entries: dict  # pool -> entry count of the decode-side arena


@dataclass(frozen=True)
class PrefillDone:
    TYPE: ClassVar[str] = "prefill_done"
    request_id: str
    transfer: dict  # TransferFigures fields
    resizes: list  # elastic.ResizeFigures fields, per boundary move during the request (v2)


@dataclass(frozen=True)
class Failed:
    TYPE: ClassVar[str] = "failed"
    request_id: str
    reason: str


PROTOCOL = Protocol(
    "pdxfer-example", 2,  # 2: resizes; RoutedGenerate (the cluster example's router)
    [Hello, HelloReply, Generate, GenerateDone, Prefill, PrefillDone, Failed, RoutedGenerate],
)


def figures_to_wire(f: TransferFigures) -> dict[str, Any]:
    return {"nbytes": f.nbytes, "segments": f.segments,
            "layer_major_segments": f.layer_major_segments, "transfer_s": f.transfer_s}


def figures_from_wire(d: dict[str, Any]) -> TransferFigures:
    """The nested dict checked here, where its schema is known (wire checks top level)."""
    try:
        return TransferFigures(
            nbytes=int(d["nbytes"]), segments=int(d["segments"]),
            layer_major_segments=int(d["layer_major_segments"]),
            transfer_s=float(d["transfer_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerLostError(f"malformed transfer figures from peer: {d!r}") from exc


def parse_hostport(text: str) -> tuple[str, int]:
    """`host:port` -> (host, port), or a ValueError saying what the form is."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class RpcClient:
    """One blocking connection to a worker; every receive has a deadline."""

    def __init__(self, address: str, timeout: float) -> None:
        host, port = parse_hostport(address)
        self.address = address
        self.timeout = timeout
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot reach worker at {address}: {exc}") from exc
        self.sock.settimeout(timeout)

    def send(self, msg: Any) -> None:
        PROTOCOL.send(self.sock, msg)

    def recv(self, timeout: float | None = None) -> Any:
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        return PROTOCOL.recv(self.sock)

    def call(self, msg: Any, timeout: float | None = None) -> Any:
        self.send(msg)
        return self.recv(timeout)

    def readable(self, timeout: float) -> bool:
        """Whether a reply (or the peer's hang-up) is waiting, within `timeout` s."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def expect_reply(msg: Any, kind: type, request_id: str | None = None) -> Any:
    """`msg` if it is a `kind` (for `request_id`); a `Failed` becomes RuntimeError."""
    if isinstance(msg, Failed):
        raise RuntimeError(msg.reason)
    if not isinstance(msg, kind):
        raise PeerLostError(f"expected {kind.TYPE}, peer sent {type(msg).TYPE}")
    if request_id is not None and msg.request_id != request_id:
        raise PeerLostError(f"reply for request {msg.request_id!r}, expected {request_id!r}")
    return msg


_WAKE_S = 0.2  # how late serve_forever notices a signal another thread received


class RpcServer:
    """Accepts connections and answers each message with `handler(msg)`.

    One thread per connection; the handler decides what may run concurrently.
    A handler exception is a bug in the worker, so it is reported to the peer
    as a `Failed` for that request and logged, and the connection stays up.
    A frame the protocol refuses gets an `ErrorMessage` and a hang-up.
    `log` receives error lines only.
    """

    def __init__(self, host: str, port: int, handler: Callable[[Any], Any],
                 log: Callable[[str], None]) -> None:
        self._handler = handler
        self._log = log
        self._sock = socket.create_server((host, port))
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    def serve_forever(self) -> None:
        """Accept until `close()`; returns then."""
        while not self._closed.is_set():
            try:
                # A bounded wait, not a blocking accept: the kernel may hand a
                # SIGINT/SIGTERM to any thread (an engine's), and Python runs
                # the handler only when the main thread next runs bytecode; a
                # main thread parked in accept() would never stop (seen: 2 of
                # 4 decode workers ignored a burst of signals for good).
                ready, _, _ = select.select([self._sock], [], [], _WAKE_S)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except OSError:
                break
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                try:
                    msg = PROTOCOL.recv(conn)
                except (PeerLostError, TransferTimeout):
                    return
                except ProtocolError as exc:
                    # Say why before hanging up: the frame stream is out of
                    # step now, so nothing after this frame can be trusted.
                    self._log(f"refused a frame: {exc}")
                    PROTOCOL.send(conn, ErrorMessage(str(exc)))
                    return
                try:
                    reply = self._handler(msg)
                except Exception as exc:  # noqa: BLE001 - reported to the peer, see docstring
                    self._log(f"handler failed on {type(msg).TYPE}: {exc!r}")
                    reply = Failed(getattr(msg, "request_id", ""), f"worker error: {exc!r}")
                PROTOCOL.send(conn, reply)
        except PeerLostError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and hang up on every peer. Idempotent."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
