"""PD-engine failures, children of the one root every pdxfer error shares.

Transport causes (`PeerLostError`, `TransferTimeout`, `BoundsError`, ...) are
re-exported unchanged rather than wrapped, so a caller catching
`PeerLostError` catches it whether the socket or the handshake noticed.
"""

from __future__ import annotations

from pdxfer.layout.errors import LayoutError, PdxferError
from pdxfer.transport.errors import (
    BoundsError,
    CapabilityError,
    ClosedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)


class ConfigError(PdxferError, ValueError):
    """An `EngineConfig` (or engine constructor argument) that cannot work; names the field."""


class LayoutMismatchError(PdxferError):
    """Prefill and decode disagree on a pool's bytes; names the pool and field."""


class RequestError(PdxferError):
    """A request-level refusal: unknown id, duplicate id, wrong pools or indices."""


class UnknownRequestError(RequestError):
    """The id names no request here (never submitted, or released): tell it apart without text.

    On a prefill this also means "no decode has expected it yet, and the
    caller has not sent it": an adapter polling for the Expect catches this.
    """


class ResizeBlockedError(RequestError):
    """A pool resize refused because requests still use entries it would move or retire.

    `request_ids` names them (sorted): the resize may run once they finished
    (Success or Failed), which `Engine.resize(..., wait=...)` can wait for.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


class RequestFailed(PdxferError):
    """A request ended in failure; `.reason` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


__all__ = [
    "BoundsError",
    "CapabilityError",
    "ClosedError",
    "ConfigError",
    "LayoutError",
    "LayoutMismatchError",
    "PdxferError",
    "PeerLostError",
    "ProtocolError",
    "RegistrationError",
    "RequestError",
    "RequestFailed",
    "ResizeBlockedError",
    "TransferTimeout",
    "TransportError",
    "UnknownRequestError",
]
