"""Typed, versioned, length-prefixed msgpack frames — the only wire format we speak.

Every control message in the project (TCP data-plane headers, the PD
handshake, request control) is a frozen dataclass registered with a
`Protocol`. A frame is a 4-byte big-endian length followed by one msgpack map
`{"p": protocol, "v": version, "t": type, "b": {field: value}}`; decoding is
strict at every level: the envelope must have exactly those keys, the
protocol and version must match, the type must be registered, and the body
must carry exactly the dataclass's fields with the declared types. Anything
else is a `ProtocolError` naming what was wrong — never a `KeyError` deep in a
handler, never positional decoding of a list, and never pickle.

Sizes are refused before allocation, and nothing is allocated on a peer's
word: a length prefix over the limit is a `ProtocolError` raised before a
byte of the body is read, and a body's buffer grows with the bytes that
actually arrive (`recv_exact`), so a peer that announces a large frame and
then stalls costs us what it sent, not what it announced. Listeners pass
`HANDSHAKE_MAX_FRAME` as the limit until a peer has completed its handshake
(`Protocol.recv(sock, limit)`): an unauthenticated peer is held to a few KiB;
after the handshake the protocol's own `max_frame` applies. A `deadline`
(`time.monotonic()` seconds) bounds a whole frame, not each read: a peer
that trickles a byte at a time cannot hold the reader past it (the dial's
handshake, `transport.dial`).

Deliberately absent: nested-schema validation. A field typed `dict` or `list`
is checked to be one; what is inside is the consuming handler's to check,
because only it knows which values are acceptable (a region id it registered,
a pool name it owns).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
import types
import typing
from collections.abc import Iterable
from typing import Any, ClassVar

import msgpack

from .errors import PeerLostError, ProtocolError, TransferTimeout

LENGTH = struct.Struct("!I")
DEFAULT_MAX_FRAME = 1 << 20
# The largest frame a listener reads before the peer's handshake: every
# protocol's first frame (an engine id and a few ints) fits many times over.
HANDSHAKE_MAX_FRAME = 4096
# A body is read in pieces of at most this many bytes: the buffer grows by
# what arrived, never by what the length prefix claims.
_RECV_PIECE = 256 * 1024
_ENVELOPE_KEYS = frozenset({"p", "v", "t", "b"})


@dataclasses.dataclass(frozen=True)
class ErrorMessage:
    """Sent back to a peer whose frame we refused, before we hang up on it."""

    TYPE: ClassVar[str] = "error"
    reason: str


def _checker(annotation: Any) -> tuple[type, ...]:
    """The runtime types a field annotation admits (top level only)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: tuple[type, ...] = ()
        for arg in typing.get_args(annotation):
            out += _checker(arg)
        return out
    if annotation is type(None):
        return (type(None),)
    if origin is not None:
        return (origin,)
    if annotation is float:
        return (float, int)
    return (annotation,)


class Protocol:
    """One named, versioned set of message types sharing the frame format.

    Exists so the data plane and the PD control plane can each evolve their
    own version while sharing one encoder, one decoder and one set of limits.
    """

    def __init__(
        self,
        name: str,
        version: int,
        messages: Iterable[type],
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.name = name
        self.version = version
        self.max_frame = max_frame
        self._types: dict[str, tuple[type, dict[str, tuple[type, ...]]]] = {}
        for cls in [ErrorMessage, *messages]:
            hints = typing.get_type_hints(cls)
            fields = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
            if cls.TYPE in self._types:
                raise ProtocolError(f"message type {cls.TYPE!r} registered twice in protocol {name}")
            self._types[cls.TYPE] = (cls, fields)

    # -- encoding ---------------------------------------------------------
    def pack(self, msg: Any) -> bytes:
        """The whole frame for `msg`: length prefix and msgpack body."""
        kind = type(msg).TYPE
        if kind not in self._types or self._types[kind][0] is not type(msg):
            raise ProtocolError(f"{type(msg).__name__} is not a {self.name} message")
        body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
        payload = msgpack.packb(
            {"p": self.name, "v": self.version, "t": kind, "b": body}, use_bin_type=True
        )
        if len(payload) > self.max_frame:
            raise ProtocolError(
                f"{kind} frame of {len(payload)} B exceeds the {self.max_frame} B limit "
                f"of protocol {self.name}; send fewer items per message"
            )
        return LENGTH.pack(len(payload)) + payload

    # -- decoding ---------------------------------------------------------
    def check_length(self, length: int, limit: int | None = None) -> None:
        """Refuse a length prefix over `limit` (default: the protocol's `max_frame`)."""
        limit = self.max_frame if limit is None else min(limit, self.max_frame)
        if length > limit:
            raise ProtocolError(
                f"frame length {length} B exceeds the {limit} B limit of "
                f"protocol {self.name}; the peer is corrupt or speaks something else"
            )

    def unpack(self, payload: bytes) -> Any:
        """Decode one frame body (without its length prefix) into its message."""
        try:
            # No size limit argument here: unpackb takes none (that is an
            # Unpacker option), and check_length has already bounded the body.
            env = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated classes
            raise ProtocolError(f"undecodable {self.name} frame: {exc}") from exc
        if not isinstance(env, dict) or set(env) != _ENVELOPE_KEYS:
            raise ProtocolError(
                f"{self.name} frame is not an envelope map with keys p/v/t/b: {type(env).__name__}"
            )
        if env["p"] != self.name:
            raise ProtocolError(f"frame is for protocol {env['p']!r}, expected {self.name!r}")
        if env["v"] != self.version:
            raise ProtocolError(
                f"peer speaks {self.name} version {env['v']!r}, we speak {self.version}; "
                "upgrade the older side"
            )
        kind = env["t"]
        if not isinstance(kind, str) or kind not in self._types:
            raise ProtocolError(f"unknown {self.name} message type {kind!r}")
        cls, fields = self._types[kind]
        body = env["b"]
        if not isinstance(body, dict) or set(body) != set(fields):
            got = sorted(body) if isinstance(body, dict) else type(body).__name__
            raise ProtocolError(f"{kind} message has fields {got}, expected {sorted(fields)}")
        for name, allowed in fields.items():
            value = body[name]
            # bool is an int subclass; a flag arriving where a count is due is a bug.
            bad_bool = isinstance(value, bool) and bool not in allowed
            if bad_bool or not isinstance(value, allowed):
                raise ProtocolError(
                    f"{kind}.{name} is {type(value).__name__}, expected "
                    f"{' | '.join(t.__name__ for t in allowed)}"
                )
        return cls(**body)

    # -- sockets ----------------------------------------------------------
    def send(self, sock: socket.socket, msg: Any) -> None:
        """Write one message to a blocking socket; a dead peer is `PeerLostError`."""
        frame = self.pack(msg)
        try:
            sock.sendall(frame)
        except OSError as exc:
            raise PeerLostError(f"{self.name}: sending {type(msg).TYPE} failed: {exc}") from exc

    def recv(self, sock: socket.socket, limit: int | None = None,
             deadline: float | None = None) -> Any:
        """Read one message from a blocking socket (honouring its timeout, and `deadline`).

        `limit` caps this frame below `max_frame`: a listener passes
        `HANDSHAKE_MAX_FRAME` until the peer's handshake is done. `deadline`
        (monotonic seconds) ends the whole frame's read: `TransferTimeout`.
        """
        head = recv_exact(sock, LENGTH.size, self.name, deadline)
        (length,) = LENGTH.unpack(head)
        self.check_length(length, limit)
        return self.unpack(recv_exact(sock, length, self.name, deadline))


def recv_exact(sock: socket.socket, nbytes: int, what: str = "peer",
               deadline: float | None = None) -> bytes:
    """Exactly `nbytes` from `sock`, or `PeerLostError`/`TransferTimeout`.

    The buffer grows piece by piece with what arrives: a peer that announces
    16 MiB and sends 12 bytes holds 12 bytes of ours, not 16 MiB. With a
    `deadline` each read waits only for what is left of it.
    """
    buf = bytearray()
    while len(buf) < nbytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"{what}: frame incomplete at its deadline "
                                      f"({len(buf)}/{nbytes} B)")
            sock.settimeout(left)
        try:
            piece = sock.recv(min(nbytes - len(buf), _RECV_PIECE))
        except TimeoutError as exc:
            raise TransferTimeout(f"{what}: no data for {sock.gettimeout()} s") from exc
        except OSError as exc:
            raise PeerLostError(f"{what}: connection failed: {exc}") from exc
        if not piece:
            raise PeerLostError(f"{what}: peer closed the connection after {len(buf)}/{nbytes} B")
        buf += piece
    return bytes(buf)
