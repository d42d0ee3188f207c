"""The one small interface every backend implements.

A transport moves byte ranges between registered memory. It knows nothing of
fields, entries or requests: the caller hands it a *segment table* — an int64
array `[n, 3]` of `(src_offset, dst_offset, nbytes)`, offsets counted from the
start of the local and remote region — and one write posts the whole table.

The shape follows NIXL's good idea: register once, describe once, and pass
index arrays per request. A `LocalRegion` is registered at start-up and its
`descriptor()` (a plain msgpack-able dict) is sent to peers once, in the
handshake; every later write names it and carries only the table.

Capabilities are flags on the engine class so callers ask rather than guess:
a PD engine checks `cuda_memory` before registering a GPU pool, and a tcp
backend that must bounce CUDA memory through host memory says so. An
instance may narrow its class's flags from its options (nixl's `tls`, a
forced `fence=False`): always ask the instance, `engine.capabilities`.

This module is the contract only; the kit that implements most of it once
for every backend is `transport.engine`, `transport.link`, `transport.inbound`
(docs/architecture.md, "How to add a backend").

Deletion condition for this module: none — adding a backend means one small
folder on the kit and one line in `transport.registry`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# What a receiving engine calls for each notify payload, with the sending
# engine's id, after that transfer's bytes are all in its memory. Runs on a
# backend I/O thread: keep it short and never block in it.
NotifyHandler = Callable[[str, bytes], None]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; ask before you rely on it."""

    cuda_memory: bool  # registers CUDA tensors (possibly via a host bounce)
    cuda_zero_copy: bool  # ... and moves them without a host bounce
    cross_process: bool  # peers may live in other processes / hosts
    one_sided: bool  # writes land without the receiver's CPU copying bytes
    notify: bool  # write(..., notify=...) is delivered after the data
    read: bool  # connection.read() is implemented
    # drop_peer is a real fence: after it returns no byte of the peer's earlier
    # writes lands. False for one-sided paths nothing on our side can stop (UCX
    # cma/cuda_ipc/rc, verbs fence="qp") and when a test forces `fence=False`;
    # the engine then quarantines failed requests instead of fencing (#11).
    fence: bool = True
    # peers reach it through a socket listener (its address() names host and
    # port; listener hardening and dial deadlines apply). False for loopback.
    listens: bool = True


class LocalRegion(abc.ABC):
    """A registered, contiguous byte range of local memory."""

    region_id: int
    length: int
    device: str  # "cpu" or "cuda"

    @abc.abstractmethod
    def descriptor(self) -> dict[str, Any]:
        """What a peer needs to address this region: a plain msgpack-able dict.

        Always holds `backend`, `engine` (the owning engine's id), `region`,
        `length` and `device`; backends may add keys of their own.
        """


class TransferHandle(abc.ABC):
    """One posted write. Completion means every byte is in the peer's memory."""

    @abc.abstractmethod
    def poll(self) -> bool:
        """True when done, False while in flight; raises the transfer's error if it failed."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until done; `TransferTimeout` past `timeout`, or the transfer's own error."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes the transfer moves."""


class Connection(abc.ABC):
    """A sender's link to one peer engine."""

    @abc.abstractmethod
    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
        *,
        ready: Any = None,
    ) -> TransferHandle:
        """Post the whole segment table as one transfer, local → remote.

        Every segment is checked against both regions before a byte moves
        (`BoundsError`); `notify`, if given, is delivered to the peer's
        notify handler after every byte of this transfer has landed.
        `ready`: for a CUDA source, the `torch.cuda.Event` (or stream) after
        which its bytes are final; None records the caller's current stream
        now. Host memory takes None. The contract: `transport.streams`.
        """

    def read(
        self, local: LocalRegion, remote: dict[str, Any], segments: np.ndarray
    ) -> TransferHandle:
        """Pull remote → local (columns: remote offset, local offset, nbytes). Optional."""
        from .errors import CapabilityError

        raise CapabilityError(f"{type(self).__name__} does not support read; use write")

    @property
    def incarnation(self) -> str | None:
        """The name the peer's engine knows this link by: ask it `settled(our engine id, this)`.

        A new name per link: a connection replaced after a close or a failure
        has another. None where the backend cannot name it (then only
        `settled(engine_id)`, every link, can be asked).
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Fail whatever is in flight with `ClosedError` and release the link. Idempotent.

        Closing is the *sender's* act and stops it sending; it is not a fence
        on the receiver. Bytes already handed to the network (tcp's socket
        buffers) may still land in the receiver's memory after `close`
        returns, until the receiver has read them or fences this sender with
        `drop_peer`. A receiver that reuses the destination of a failed or
        abandoned transfer fences the sender first.
        """


class TransportEngine(abc.ABC):
    """One per process per backend: owns registrations, listeners and I/O threads."""

    name: str
    capabilities: Capabilities
    engine_id: str  # unique per engine instance; peers see it in address() and descriptors

    @abc.abstractmethod
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        """Register a contiguous tensor's bytes once; overlapping memory is refused."""

    @abc.abstractmethod
    def deregister(self, region: LocalRegion) -> None:
        """Forget a region. Idempotent."""

    @abc.abstractmethod
    def address(self) -> dict[str, Any]:
        """Where peers connect to this engine: a plain msgpack-able dict."""

    @abc.abstractmethod
    def connect(self, peer_address: dict[str, Any]) -> Connection:
        """Open (or reuse) a connection to the engine at `peer_address`."""

    @abc.abstractmethod
    def set_notify_handler(self, handler: NotifyHandler | None) -> None:
        """Install the callback receiving notify payloads (None drops them)."""

    @abc.abstractmethod
    def drop_peer(self, engine_id: str) -> None:
        """Fence a peer: close every inbound link from engine `engine_id`.

        After this returns, no byte of any write that engine posted earlier
        lands in our memory (in-progress receives are finished or cut off
        first). This is what lets a receiver reuse entries of a request whose
        sender stalled or died. The peer may connect again afterwards.
        """

    def has_peer(self, engine_id: str) -> bool:
        """Whether any inbound link from engine `engine_id` is still open (its bytes may still land).

        What a receiver that cannot fence (`capabilities.fence` False) asks to
        learn that a lost peer is really gone: once this is False after its
        control link died, nothing of that peer's can land any more. The
        default says True — a backend that cannot tell never lets a caller
        conclude a peer is gone.
        """
        del engine_id
        return True

    def usage(self) -> dict[str, int]:
        """What this engine holds now, as counts and bytes (#23: memory that must not grow with peers).

        The kit's engines report `links_out`, `links_in`, `threads` (Python
        threads of this process, for scale), `device_scratch_bytes` and each
        backend's own: tcp `bounce_bytes` (pinned once CUDA memory is
        registered), nixl `registrations` and `prepared_descriptors`. A
        backend outside the kit may report nothing.
        """
        return {}

    def settled(self, engine_id: str, incarnation: str | None = None) -> bool:
        """Whether no byte of engine `engine_id`'s link `incarnation` (None: any link) can still land.

        What a receiver that cannot fence asks before it hands back memory a
        failed transfer of that peer may still be writing: True once every
        such link has ended *and* its ending proves nothing of it arrives —
        our own reading stopped (tcp: EOF after the last buffered byte), or,
        where the sender writes into our memory (one-sided paths with no
        fence), the sender said every operation it posted there ended, or
        died. `incarnation` is the sender's `Connection.incarnation`; one
        never seen here has nothing left to land. The default says False —
        a backend that cannot tell never lets a caller conclude. Per
        backend: docs/reliability.md, "What ends a no-fence quarantine".
        """
        del engine_id, incarnation
        return False

    def refuse_new_links(self, engine_id: str) -> None:
        """Refuse new inbound links from `engine_id` until every link it has now has settled.

        Lifted by itself once `settled(engine_id)` holds. What a receiver that
        cannot fence does when it lost its control channel to that peer while
        a request the peer may still write is quarantined: a peer that has not
        noticed yet could otherwise open a fresh link after the old ones ended
        — after `settled` said True — and post a transfer it still had queued.
        The default refuses nothing (a backend off the kit; the window stays).
        """
        del engine_id

    @abc.abstractmethod
    def close(self) -> None:
        """Fail in-flight work, stop and join its threads (bounded), deregister everything.

        Idempotent; always returns. Joins every thread the engine started, so
        none is still inside a copy when the interpreter exits.
        """

    def __enter__(self) -> TransportEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

