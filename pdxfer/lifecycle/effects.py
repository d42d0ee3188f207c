"""What a transition asks its driver to do: the effects, and the two waits a request obeys.

Plain frozen values, so a test compares a transition's result with `==`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import KVPoll


# -- effects ------------------------------------------------------------------------
@dataclass(frozen=True)
class Post:
    """Plan and post `chunk` on the peer's data connection now (in the order returned)."""

    chunk: Any


@dataclass(frozen=True)
class Send:
    """Send `msg` on the request's control link (on the progress thread)."""

    msg: Any


@dataclass(frozen=True)
class Cut:
    """Close the data connection to the request's peer: its transfers stop reading now."""


@dataclass(frozen=True)
class Fence:
    """`drop_peer` the request's prefill, then report `on_fenced()`: nothing of it lands after."""


@dataclass(frozen=True)
class Quarantine:
    """Show the request as Quarantined with `reason`: failed, but its entries are not free yet."""

    reason: str
    error: BaseException | None = None


@dataclass(frozen=True)
class Finish:
    """The request is final: Success (`ok`) or Failed with `reason` and `error`."""

    ok: bool
    reason: str | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Timing:
    """The two waits a request obeys, from `EngineConfig` (`request_wait`, `grace`)."""

    wait: float  # no progress for this long while waiting for input or confirmation: fail
    grace: float  # a failing request's transfers get this long before they are cut


def visible(table: dict, life: Any) -> KVPoll:
    """The caller's `KVPoll` for `life.phase`; a transitional phase shows the last running state.

    Failing, aborting and fencing are not states a caller can act on: until
    the request is final it still reads as where it was.
    """
    state = table.get(life.phase)
    if state is None:
        return life.seen
    if not state.finished:
        life.seen = state
    return state
