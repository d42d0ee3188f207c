"""The tcp data plane's messages: every header and control frame a stream carries.

A stream (one TCP connection of a striped link) carries, sender → receiver,
`Hello` once, then per stripe of a transfer a run of `Segments` frames each
followed by the payload bytes it announces, then one `StripeEnd`; and
receiver → sender `Welcome`, `Ack` (a whole transfer landed, on whichever
stream finished it last), `RegionReply` and, before the receiver hangs up on
a bad frame, `Refused` or the wire's `ErrorMessage`.

`Segments.ranges` is the batch's `(dst_offset, nbytes)` pairs as raw
little-endian int64 bytes — one msgpack `bin` rather than a list of ints, so a
512-row header costs one buffer copy to build and one `np.frombuffer` to
check, not 1,024 msgpack integers.

Payload bytes are *not* frames: they follow their header raw, so the receiver
can `recvmsg_into` them straight into the destination region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..wire import DEFAULT_MAX_FRAME, Protocol

VERSION = 1
# Rows per Segments frame: a header plus this many payload buffers (plus a
# trailing StripeEnd) fit one sendmsg / recvmsg_into under IOV_MAX = 1024.
# As many as fit, because every batch costs a header, a check and ~3 calls.
MAX_ROWS = 1000


@dataclass(frozen=True)
class Hello:
    """First frame on every stream: who sends, which link, which stream of how many."""

    TYPE: ClassVar[str] = "hello"
    engine: str
    link: str
    stream: int
    streams: int


@dataclass(frozen=True)
class Welcome:
    """The receiver's answer to `Hello`: its engine id, so a sender knows it reached the right peer."""

    TYPE: ClassVar[str] = "welcome"
    engine: str


@dataclass(frozen=True)
class RegionQuery:
    """Does region `region` exist, and how long is it? Asked once per region per link."""

    TYPE: ClassVar[str] = "region?"
    query: int
    region: int


@dataclass(frozen=True)
class RegionReply:
    """Answer to `RegionQuery`; `length` is -1 when the region is unknown."""

    TYPE: ClassVar[str] = "region"
    query: int
    region: int
    length: int
    device: str


@dataclass(frozen=True)
class Segments:
    """Header of one batch: the payload that follows lands at these ranges of `region`."""

    TYPE: ClassVar[str] = "segments"
    transfer: int
    region: int
    ranges: bytes  # little-endian int64 pairs (dst_offset, nbytes)


@dataclass(frozen=True)
class StripeEnd:
    """End of this stream's share of `transfer`: `nbytes` in all, one of `stripes` shares."""

    TYPE: ClassVar[str] = "stripe-end"
    transfer: int
    stripes: int
    nbytes: int
    notify: bytes | None  # carried by stripe 0 only, delivered after every stripe landed


@dataclass(frozen=True)
class Ack:
    """Every byte of `transfer` is in the receiver's memory and its notify was delivered."""

    TYPE: ClassVar[str] = "ack"
    transfer: int


@dataclass(frozen=True)
class Refused:
    """The receiver refused a header of `transfer` and is closing the stream."""

    TYPE: ClassVar[str] = "refused"
    transfer: int
    cause: str  # "region": unknown / changed region; "protocol": anything else
    reason: str


PROTOCOL = Protocol(
    "pdxfer-tcp",
    VERSION,
    [Hello, Welcome, RegionQuery, RegionReply, Segments, StripeEnd, Ack, Refused],
    max_frame=DEFAULT_MAX_FRAME,
)
