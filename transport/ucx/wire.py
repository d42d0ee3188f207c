"""The ucx backend's control frames: what travels beside the tag messages that carry the bytes.

UCXX moves bytes two-sided: the receiver must post a receive for every run
before it can land. So each write is first *announced* on the link's TCP
control connection (`transport.control`), in `transport.wire` frames of
protocol `pdxfer-ucx`:

  sender → receiver: `Hello` once; per write one or more `Announce`
  frames (the destination runs, in order, each run a `(dst_offset, nbytes)`
  pair; the last part carries the notify); `Refresh`; `Bye`;
  receiver → sender: `Welcome` (the UCX worker address of the worker that
  serves this link alone, and the regions it may write), `Posted` (the
  receives of these transfers are posted: send), `Regions` (answer to
  `Refresh`), `Acks` (these transfers landed and their notify was
  delivered), `Gone`, and the wire's `ErrorMessage` before it hangs up on a
  bad announce.

The bytes themselves are UCX tag messages, one per run, tagged
`(transfer, run)` (`lib.tag`). The sender posts them only once the
receiver said `Posted`: a tag message that arrives before its receive is
posted is buffered by UCX in memory of its own (and copied once more) —
unbounded for large writes. One control round trip per write buys that
bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..control import Acks, Bye, Gone, Refresh
from ..wire import DEFAULT_MAX_FRAME, Protocol

# 2: Welcome.link, Bye.quiet (#25.1). 3: Hello.worker_sum, Welcome.worker_sum — UCX parses a
# worker address without knowing its length, so one corrupted byte segfaulted the receiving
# process; each side now sends the checksum of its address and the other refuses a mismatch
# before UCX sees it (`lib.check_address`, #35.5).
VERSION = 3
# Runs per Announce frame: 16 B each, so a frame stays well under max_frame.
MAX_ROWS = 32768


@dataclass(frozen=True)
class Hello:
    """First frame from a connecting sender: its engine id and its sending worker's UCX address."""

    TYPE: ClassVar[str] = "hello"
    engine: str
    worker: bytes  # the receiver's link worker opens an endpoint to it: receives are posted there
    worker_sum: bytes  # `lib.address_sum(worker)`: checked before UCX parses the address


@dataclass(frozen=True)
class Welcome:
    """The receiver's answer: the worker that serves this link alone, and the regions it may write."""

    TYPE: ClassVar[str] = "welcome"
    engine: str
    worker: bytes  # UCX worker address
    worker_sum: bytes  # `lib.address_sum(worker)`
    regions: bytes  # little-endian int64 rows (region_id, length)
    link: str  # the receiver's name for this link (`Connection.incarnation`)


@dataclass(frozen=True)
class Regions:
    """Answer to `Refresh`: the full region list."""

    TYPE: ClassVar[str] = "regions"
    query: int
    regions: bytes


@dataclass(frozen=True)
class Announce:
    """Runs `first..first+len(runs)` of transfer `transfer`, into region `region`; `runs` in all.

    The part holding the transfer's last run carries `notify` (None: no
    payload) and ends the announcement; `runs == 0` is a notify-only write.
    """

    TYPE: ClassVar[str] = "announce"
    transfer: int
    region: int
    first: int
    runs: int
    ranges: bytes  # little-endian int64 pairs (dst_offset, nbytes)
    notify: bytes | None


@dataclass(frozen=True)
class Posted:
    """The receiver posted every receive of these transfers: their runs may be sent."""

    TYPE: ClassVar[str] = "posted"
    seqs: bytes  # little-endian int64 transfer numbers


CONTROL = Protocol(
    "pdxfer-ucx", VERSION,
    [Hello, Welcome, Refresh, Regions, Acks, Gone, Bye, Announce, Posted],
    max_frame=DEFAULT_MAX_FRAME,
)


def region_rows(regions: list) -> bytes:
    """`(region_id, length)` rows as raw little-endian int64 bytes."""
    return np.array([[r.region_id, r.length] for r in regions], dtype="<i8").reshape(-1, 2).tobytes()


def announce(seq: int, region: int, runs: np.ndarray, notify: bytes | None) -> list[Announce]:
    """The `Announce` frames of one write: its `[n, 2]` (dst_offset, nbytes) runs, cut by `MAX_ROWS`."""
    n = int(runs.shape[0])
    if n == 0:
        return [Announce(seq, region, 0, 0, b"", notify)]
    raw = np.ascontiguousarray(runs, dtype="<i8")
    out = []
    for first in range(0, n, MAX_ROWS):
        last = min(first + MAX_ROWS, n)
        out.append(Announce(seq, region, first, n, raw[first:last].tobytes(),
                            notify if last == n else None))
    return out
