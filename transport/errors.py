"""Transport failures, one class per cause.

Callers branch on cause — retry a peer that was lost, fix the caller's segment
table, raise a timeout — so each cause is its own class under `TransportError`,
and every backend translates its native failure (socket errors, NIXL status
codes, verbs completions) into one of these at its own edge with `from exc`.
Nothing here is ever returned as a code.
"""

from __future__ import annotations

from pdxfer.layout.errors import PdxferError


class TransportError(PdxferError):
    """Root of every transport failure."""


class BoundsError(TransportError, ValueError):
    """A segment or index names bytes outside the regions it addresses."""


class RegistrationError(TransportError):
    """Memory that cannot be registered, or a region that is not registered."""


class CapabilityError(TransportError):
    """The backend cannot do what was asked (e.g. CUDA memory over a host-only backend)."""


class DeviceRegistrationError(RegistrationError, CapabilityError):
    """GPU memory the NIC cannot register; `missing` names what this host lacks for it.

    The pieces, in `transport.gpudirect`'s words: "nvidia_peermem" (the kernel
    module), "dma-buf" (a 5.12+ kernel and a driver that exports it), "memlock"
    (`RLIMIT_MEMLOCK` below the bytes pinned). A `CapabilityError` too: the
    host cannot do it, whatever the caller changes in its call.
    """

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class ProtocolError(TransportError):
    """A malformed, oversized, unknown-type or wrong-version control frame."""


class PeerLostError(TransportError, ConnectionError):
    """The peer went away (connection reset, process died) before the work finished."""


class TransferTimeout(TransportError, TimeoutError):
    """A wait ran out before the transfer completed."""


class ClosedError(TransportError):
    """The engine or connection was closed while, or before, it was used."""


class CloseError(TransportError):
    """One or more steps of a `close()` failed; every other step still ran.

    `failures` holds `(step, exception)` pairs in the order they ran; the
    first is also the `__cause__`. Calling `close()` again retries the steps
    that failed (and only those).
    """

    def __init__(self, what: str, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = tuple(failures)
        named = "; ".join(f"{step}: {type(exc).__name__}: {exc}" for step, exc in self.failures)
        super().__init__(f"closing {what}: {len(self.failures)} step(s) failed ({named}); every "
                         "other step ran — close() again retries the failed ones")


def again(error: BaseException) -> BaseException:
    """A fresh exception to raise for a stored one: same type, message and fields, `from` it.

    Raising a stored exception object in place appends the raising frames to
    its traceback every time (2 frames per `poll()`: 2,000 after 1,000 polls),
    and two threads raising the one object race on it. The copy skips
    `__init__` (any signature works) and is chained to the stored one, whose
    traceback stays the one of its first raise.
    """
    cls = type(error)
    fresh = cls.__new__(cls, *error.args)
    fresh.args = error.args
    fresh.__dict__.update(error.__dict__)
    fresh.__cause__ = error
    return fresh
