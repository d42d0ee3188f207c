"""What the nixl backend says besides NIXL itself: control frames and the notification.

NIXL moves the bytes and carries one notification per transfer; everything
else — who is connecting, which regions exist at which addresses, which
transfers landed, a peer going away — travels on one small TCP control
connection per link (`transport.control`), in `transport.wire` frames of
protocol `pdxfer-nixl`:

  sender → receiver: `Hello` once, `Refresh` (a region unknown to us was
  named), `GoneAck` (answer to `Gone`: no write naming that region is queued
  or in flight any more, and none will be posted), `Bye` (we are closing:
  fence us; `quiet` once every write we posted on the link ended — the proof
  a receiver that cannot fence waits for, #25.1);
  receiver → sender: `Welcome` (its NIXL agent's metadata and its regions),
  `Regions` (answer to `Refresh`), `Acks` (these transfers landed and their
  notify was delivered), `Gone` (a region was deregistered).

The control connection is also how a dead peer is noticed: UCX over tcp may
take long to declare a killed process gone, a closed socket is seen at once.

Every NIXL transfer carries a `Note` as its notification — the transfer's
sequence number and the caller's notify payload, if any — so the receiver
can acknowledge each transfer even when the caller sent no payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..control import Acks, Bye, Gone, Refresh
from ..wire import LENGTH, Protocol

# 2: region rows carry the CUDA device (-1: host); 3: Welcome.link, Bye.quiet (#25.1);
# 4: GoneAck (#19: a receiver lets a deregistered region go once its senders answer `Gone`)
VERSION = 4


@dataclass(frozen=True)
class Hello:
    """First frame from a connecting sender: its engine id (= its NIXL agent's name)."""

    TYPE: ClassVar[str] = "hello"
    engine: str


@dataclass(frozen=True)
class Welcome:
    """The receiver's answer: the agent that serves this link alone, and the regions it may write."""

    TYPE: ClassVar[str] = "welcome"
    engine: str
    agent: str
    metadata: bytes  # the serving agent's full NIXL metadata
    regions: bytes  # little-endian int64 rows (region_id, address, length, gpu; -1 host)
    link: str  # the receiver's name for this link (`Connection.incarnation`)


@dataclass(frozen=True)
class Regions:
    """Answer to `Refresh`: fresh metadata and the full region list."""

    TYPE: ClassVar[str] = "regions"
    query: int
    metadata: bytes
    regions: bytes


@dataclass(frozen=True)
class GoneAck:
    """The sender's answer to `Gone`: every write it posted naming `region` has ended, none will follow."""

    TYPE: ClassVar[str] = "gone-ack"
    region: int


@dataclass(frozen=True)
class Note:
    """The NIXL notification of one transfer: delivered by NIXL after its bytes."""

    TYPE: ClassVar[str] = "note"
    seq: int
    payload: bytes | None


CONTROL = Protocol(
    "pdxfer-nixl", VERSION, [Hello, Welcome, Refresh, Regions, Acks, Gone, GoneAck, Bye], max_frame=16 << 20
)
NOTES = Protocol("pdxfer-nixl-note", VERSION, [Note], max_frame=128 * 1024)


def pack_note(seq: int, payload: bytes | None) -> bytes:
    """A `Note` as NIXL notification bytes (the frame body, without its length prefix)."""
    return NOTES.pack(Note(seq, payload))[LENGTH.size:]


def unpack_note(data: bytes) -> Note:
    """The `Note` in a NIXL notification; `ProtocolError` for anything else."""
    NOTES.check_length(len(data))
    return NOTES.unpack(data)


def mem_type(gpu: int) -> str:
    """NIXL's memory type for a region on CUDA device `gpu` (-1: host memory)."""
    return "DRAM" if gpu < 0 else "VRAM"


def gpu_of(region: object) -> int:
    """The CUDA device index of a region, -1 for host memory: what NIXL's VRAM descriptors name."""
    return -1 if region.device != "cuda" else int(region.data.device.index or 0)


def region_rows(regions: list) -> bytes:
    """`(region_id, address, length, gpu)` rows as raw little-endian int64 bytes (gpu -1: host)."""
    rows = np.array([[r.region_id, r.start, r.length, gpu_of(r)] for r in regions],
                    dtype="<i8").reshape(-1, 4)
    return rows.tobytes()
