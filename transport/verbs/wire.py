"""What the verbs backend says besides RDMA: control frames on the link's socket, and the note.

Each link has one TCP control connection (the engine's listener, as tcp and
nixl have), in `transport.wire` frames of protocol `pdxfer-verbs`:

  sender -> receiver: `Hello` (its QP number, PSN and address), `Refresh`
  (a region unknown to us was named), `Bye` (we are closing: fence us; `quiet` once every WR
  we posted on the link completed or was flushed, #25.1);
  receiver -> sender: `Welcome` (its QP, the regions with their per-link
  rkeys, how many notes it can hold), `Regions` (answer to `Refresh`), `Acks`
  (these transfers landed and their notify ran: each returns a credit),
  `Gone` (a region was deregistered).

The rkey/address table travels only here, never in a descriptor, so an
edited descriptor cannot aim a write: it names a region id, and the address
and rkey come from what the receiver announced for this link alone.

The `Note` rides in-band, as the SEND that ends a transfer's stripe on the
same QP as its WRITEs: RC places it after all of them. A transfer striped
over several rails (QPs) sends one note per rail; the receiver delivers
notify once all of them arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..control import Acks, Bye, Gone, Refresh
from ..segments import MAX_NOTIFY
from ..wire import LENGTH, Protocol

VERSION = 2  # 2: Welcome.link, Bye.quiet (#25.1)


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[str] = "hello"
    engine: str
    qpns: list  # one RC QP per rail (ints, checked by the receiver)
    psns: list
    lid: int
    gid: str
    mtu: int


@dataclass(frozen=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    engine: str
    qpns: list  # the receiver's QP for each of the sender's rails, in order
    psns: list
    lid: int
    gid: str
    mtu: int
    regions: bytes  # little-endian int64 rows (region_id, address, length, rkey)
    credits: int  # receive slots per rail: notes the sender may have unacknowledged on it
    link: str  # the receiver's name for this link (`Connection.incarnation`)


@dataclass(frozen=True)
class Regions:
    TYPE: ClassVar[str] = "regions"
    query: int
    regions: bytes


@dataclass(frozen=True)
class Note:
    TYPE: ClassVar[str] = "note"
    seq: int
    rail: int  # which of the transfer's `rails` stripes this note ends
    rails: int
    payload: bytes | None  # on the last rail's note only


CONTROL = Protocol("pdxfer-verbs", VERSION, [Hello, Welcome, Refresh, Regions, Acks, Gone, Bye],
                   max_frame=16 << 20)
NOTES = Protocol("pdxfer-verbs-note", VERSION, [Note], max_frame=MAX_NOTIFY + 256)
# A receive slot holds the largest note frame.
SLOT = NOTES.max_frame


def pack_note(seq: int, rail: int, rails: int, payload: bytes | None) -> bytes:
    """A `Note` as the bytes of its SEND (the frame body, no length prefix)."""
    return NOTES.pack(Note(seq, rail, rails, payload))[LENGTH.size:]


def unpack_note(data: bytes) -> Note:
    """The `Note` in a received SEND; `ProtocolError` for anything else."""
    NOTES.check_length(len(data))
    return NOTES.unpack(data)
