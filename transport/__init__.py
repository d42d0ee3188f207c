"""Registered memory and moving byte ranges between processes.

`transport` knows byte ranges and nothing of fields or requests: register a
buffer once, describe it to a peer once, then post whole segment tables
(`[n, 3]` int64 `(src_offset, dst_offset, nbytes)`) as single transfers.

The interface is `base.py`; the kit every backend is built on sits beside it
(`engine.py`, `link.py`, `posting.py`, `inbound.py`, `listener.py`,
`dial.py`, `control.py`, `resources.py`), each backend is a folder on it
(`loopback.py`, `tcp/`, `nixl/`, `verbs/`), and `transport.testing` is the
conformance kit any backend can be run through (docs/architecture.md).
"""

from .base import (
    Capabilities,
    Connection,
    LocalRegion,
    NotifyHandler,
    TransferHandle,
    TransportEngine,
)
from .errors import (
    BoundsError,
    CapabilityError,
    ClosedError,
    CloseError,
    DeviceRegistrationError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferTimeout,
    TransportError,
)
from .registry import available, capabilities, create, known, variants, why_unavailable

__all__ = [
    "BoundsError",
    "Capabilities",
    "CapabilityError",
    "CloseError",
    "ClosedError",
    "Connection",
    "DeviceRegistrationError",
    "LocalRegion",
    "NotifyHandler",
    "PeerLostError",
    "ProtocolError",
    "RegistrationError",
    "TransferHandle",
    "TransferTimeout",
    "TransportEngine",
    "TransportError",
    "available",
    "capabilities",
    "create",
    "known",
    "variants",
    "why_unavailable",
]
