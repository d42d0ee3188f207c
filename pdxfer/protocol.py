"""The PD control protocol: typed messages between a prefill and a decode engine.

Everything the two sides say to each other that is not cache bytes is one of
these frozen dataclasses, framed by `transport.wire.Protocol` — versioned,
strictly decoded, never pickled. The control link is a plain TCP socket owned
by the engines whatever the data transport is, so loopback, tcp and RDMA
backends share one handshake and one request protocol.

The conversation:

    decode  → prefill   Hello      engine id, transport address, pools (described), regions
    prefill → decode    Welcome    engine id, pools (described)        — or Refuse(reason)
    decode  → prefill   Expect     request id, transfer id, destination indices per pool;
                                   `offsets`: per pool, the leading entries of what the prefill
                                   sends that the decode already holds (a prefix hit): the
                                   destinations name only the tail after them (version 5)
    prefill → decode    (data)     one transfer per pool, each carrying a `Landed` notify; a
                                   chunk names its span (the set of entries it belongs to) and
                                   the layers of them it carries (streamed sends, version 7)
    decode  → prefill   Done       every part of every chunk through the last has landed, and
                                   every layer of every span
    either  → other     Abort      request failed/aborted here; `fence` = bytes may still fly
    prefill → decode    AbortAck   the prefill's transfers for it are finished (`clean`) or cut
                                   (both from the prefill name its data `links` whose bytes of
                                   the request may still land: the decode waits until its
                                   transport shows them settled, version 4)
    decode  → prefill   Fenced     decode ran drop_peer on the prefill: its data connection is
                                   dead, reconnect before the next post (version 2)
    decode  → prefill   LiveRange  a pool boundary moved: the entries the decode's pools now
                                   hold, sent before any Expect naming a newly live one (v3)
    decode  → prefill   Renew      request ids the decode has queued (`DecodeEngine.hold`, not
                                   expected yet): the prefill renews their hold — a sent
                                   request's wait for its Expect starts again (version 5)
    decode  → prefill   Echo       a probe's data-path check: write `nbytes` of the echo
                                   pattern into one of the decode's regions (version 6)
    prefill → decode    EchoDone   that write's outcome and its wire time (version 6)
    either  → other     Ping       liveness while idle

A `Refuse` carries the refusing prefill's engine id, transport and pools
(version 6), so the refused side can name every difference, not only the
first (`pdxfer probe`).

`xid` is a transfer id the decode engine picks per `expect`: a request id may
be reused after `release`, and every message about a request carries the xid
so a late message about the previous use can never touch the new one.

Index arrays travel as little-endian int64 bytes (`pack_indices`), not lists:
8 B per index and one `frombuffer` to read, where a msgpack list costs a
Python object per index on both ends.

Deliberately absent: any message that moves cache bytes. Those go through the
data transport, registered and one-sided; the control link only says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from pdxfer.transport.errors import ProtocolError
from pdxfer.transport.wire import LENGTH, Protocol

VERSION = 7  # 2: Fenced; 3: LiveRange; 4: Abort/AbortAck name their `links` (#25.1);
# 5: Expect.offsets (tail-only Expect) and Renew (a decode keeps a prefill's hold, #30, #31);
# 6: Refuse says who refused and its pools, Echo/EchoDone (`pdxfer probe`, #32)
# 7: Landed names its span and layer range (streamed layer groups, #33)
# Data links an Abort/AbortAck may name: a prefill has one live data link per decode and
# a few it has just cut; anything longer is refused as malformed.
MAX_LINKS = 64
# Request ids one Renew may name: a decode with more held on one prefill sends several.
MAX_RENEW = 1024
# A Hello carries every pool's description and every region descriptor; 4 MiB
# leaves room for hundreds of fields while refusing a garbage length outright.
MAX_FRAME = 4 << 20
# Largest Echo write: a probe's data-path check and bandwidth figure, not a benchmark.
MAX_ECHO = 16 << 20


@dataclass(frozen=True)
class Hello:
    """Decode opens a control link: who it is and what its memory looks like."""

    TYPE: ClassVar[str] = "hello"
    engine: str  # the decode's transport engine id
    transport: str  # backend name; both sides must use the same one
    address: dict  # where the prefill's transport connects to post writes
    pools: dict  # name -> layout.describe(arena)
    fingerprints: dict  # name -> layout.fingerprint(desc)
    buffers: dict  # name -> [[region index, byte shift of the buffer in it], ...] per arena buffer
    regions: list  # region descriptors, indexed by `buffers`


@dataclass(frozen=True)
class Welcome:
    """Prefill accepts a Hello; decode re-checks the pools from its side."""

    TYPE: ClassVar[str] = "welcome"
    engine: str  # the prefill's transport engine id: what decode fences with drop_peer
    pools: dict
    fingerprints: dict


@dataclass(frozen=True)
class Refuse:
    """Prefill refuses a Hello (layout mismatch, wrong transport, unreachable data endpoint)."""

    TYPE: ClassVar[str] = "refuse"
    kind: str  # "layout" | "transport"
    reason: str
    # Who refused (version 6): the prefill's engine id, transport and pools, so the
    # decode (or `pdxfer probe`) can name every difference, not only the first.
    engine: str = ""
    transport: str = ""
    pools: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Expect:
    """Decode announces a request and the destination entries it allocated for it."""

    TYPE: ClassVar[str] = "expect"
    request: str
    xid: int
    indices: dict  # pool -> pack_indices(dst)
    offsets: dict = field(default_factory=dict)  # pool -> entries skipped (`check_offsets`)


@dataclass(frozen=True)
class Done:
    """Decode saw every part of every chunk land; the prefill's sources are free."""

    TYPE: ClassVar[str] = "done"
    request: str
    xid: int


@dataclass(frozen=True)
class Abort:
    """The sender's side gave up on a request; `fence` says bytes may still be in flight.

    `links` (from a prefill): its data links — `Connection.incarnation`s, as the
    decode's transport knows them — that carried a transfer of this request
    which did not complete and that are closed or closing: bytes of it may
    still land through them until the decode's transport shows them settled.
    Empty from a decode, and when every transfer completed (or none was posted).
    """

    TYPE: ClassVar[str] = "abort"
    request: str
    xid: int
    reason: str
    fence: bool
    links: list = field(default_factory=list)


@dataclass(frozen=True)
class AbortAck:
    """Prefill's answer to decode's Abort: its transfers for the request are finished.

    `clean` is False when the prefill had to cut a stuck transfer instead; the
    decode then fences the prefill before it hands the entries back — or,
    without a fence, waits until its transport shows every one of `links`
    settled (nothing of them can land any more).
    """

    TYPE: ClassVar[str] = "abort_ack"
    request: str
    xid: int
    clean: bool
    links: list = field(default_factory=list)  # as `Abort.links`


@dataclass(frozen=True)
class Fenced:
    """Decode fenced this prefill (`drop_peer`): the prefill's cached data connection is dead.

    Sent after `drop_peer` returns, so every Expect sent later reaches the
    prefill after this: it reopens its data connection before posting them,
    instead of writing into the fenced one ("Broken pipe").
    """

    TYPE: ClassVar[str] = "fenced"


@dataclass(frozen=True)
class LiveRange:
    """Decode moved a pool boundary (`Engine.resize`): its pools' entry counts now.

    `pools` maps a pool name to `[entries, live_entries]`, as `layout.describe`
    counts them (live entries at the top of the index range). Sent on every
    control link after the move and before any later Expect, so the prefill
    plans each destination against the range the decode had when it named it.
    """

    TYPE: ClassVar[str] = "live_range"
    pools: dict


@dataclass(frozen=True)
class Renew:
    """Decode still has these requests queued (admitted, not yet allocated): keep them.

    One per control link per renewal period, naming every id the decode holds
    on that prefill (`MAX_RENEW` per message), so renewal costs one message
    per period per link however many requests wait — and is carried by the
    decode's progress loop, not a timer per request.
    """

    TYPE: ClassVar[str] = "renew"
    requests: list


@dataclass(frozen=True)
class Echo:
    """A probe asks for a data-path check: `nbytes` of `echo_pattern` into one of its regions.

    The prefill writes from a pattern buffer of its own (never from its pools:
    their bytes change under a running model), at offset 0 of `region` (one
    its Hello named), and answers `EchoDone` once the write completed or
    failed (`pdxfer.echo`).
    """

    TYPE: ClassVar[str] = "echo"
    xid: int
    nbytes: int
    region: int  # the decode's region id (its descriptor's "region"), written at offset 0


@dataclass(frozen=True)
class EchoDone:
    """The prefill's answer to `Echo`: `ok`, or `error`; `wire_s` from post to completion."""

    TYPE: ClassVar[str] = "echo_done"
    xid: int
    nbytes: int
    ok: bool
    error: str
    wire_s: float


@dataclass(frozen=True)
class Ping:
    """Liveness on an idle link; any frame counts, this one says nothing else."""

    TYPE: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Landed:
    """The notify payload of one transfer, delivered to decode after its bytes.

    `parts` is how many transfers make up `chunk`; decode declares Success
    once the chunk marked `last` and every chunk before it have all parts,
    and every `span` among them has every layer landed. `span` numbers the
    sets of entries the prefill sent (one per whole-entry chunk; the layer
    ranges of one streamed set share it); `lo`, `hi`: the layers `[lo, hi)`
    of that span this chunk carries, `hi == 0` for every layer (a
    whole-entry chunk). `nbytes` and `segments` are this transfer's, so
    decode's stats match prefill's without a second message.
    """

    TYPE: ClassVar[str] = "landed"
    request: str
    xid: int
    chunk: int
    part: int
    parts: int
    last: bool
    nbytes: int
    segments: int
    span: int = 0
    lo: int = 0
    hi: int = 0  # 0: every layer


CONTROL = Protocol(
    "pdxfer-ctl",
    VERSION,
    [Hello, Welcome, Refuse, Expect, Done, Abort, AbortAck, Fenced, LiveRange, Ping, Landed, Renew,
     Echo, EchoDone],
    max_frame=MAX_FRAME,
)


def echo_pattern(nbytes: int) -> np.ndarray:
    """The bytes an Echo writes: position mod 251 (a prime, so no power-of-two stride repeats it)."""
    return (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)


def encode_notify(msg: Landed) -> bytes:
    """A notify payload: the control frame without its length prefix (the transport frames it)."""
    return CONTROL.pack(msg)[LENGTH.size:]


def decode_notify(payload: bytes) -> Landed:
    """The `Landed` in a notify payload, or `ProtocolError` for anything else."""
    msg = CONTROL.unpack(payload)
    if not isinstance(msg, Landed):
        raise ProtocolError(f"notify payload is a {type(msg).TYPE!r} message, expected 'landed'")
    return msg


def pack_indices(idx: np.ndarray) -> bytes:
    """An int64 index array as little-endian bytes for an Expect."""
    return np.ascontiguousarray(idx, dtype="<i8").tobytes()


def unpack_indices(raw: Any, what: str) -> np.ndarray:
    """The int64 array in `raw`, or `ProtocolError` naming `what` was malformed."""
    if not isinstance(raw, bytes) or len(raw) % 8:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise ProtocolError(f"{what}: indices must be int64 bytes (a multiple of 8), got {size}")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def check_offsets(offsets: Any, pools: Any, what: str) -> dict[str, int]:
    """An Expect's `offsets` as `{pool: entries >= 1}`, or `ProtocolError` naming `what`.

    Each pool must be one the Expect names destinations in (`pools`); a
    count is an int in 1..2**40 (0 is sent as absent; bool is refused).
    """
    if not isinstance(offsets, dict) or len(offsets) > len(pools):
        raise ProtocolError(f"{what}: offsets must be a map of at most {len(pools)} pools, "
                            f"got {offsets!r:.200}")
    for pool, k in offsets.items():
        if pool not in pools or isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= 1 << 40:
            raise ProtocolError(f"{what}: offset {k!r:.40} for pool {pool!r:.80} must be an entry "
                                "count 1..2**40 of a pool the Expect names")
    return offsets


def check_renew(requests: Any) -> list[str]:
    """A Renew's ids as a list, or `ProtocolError`: at most `MAX_RENEW` strs of at most 1024 chars."""
    if not isinstance(requests, list) or len(requests) > MAX_RENEW or not all(
            isinstance(rid, str) and 0 < len(rid) <= 1024 for rid in requests):
        raise ProtocolError(f"renew: requests must be at most {MAX_RENEW} request ids of 1..1024 "
                            f"characters, got {requests!r:.200}")
    return requests


def check_links(links: Any, what: str) -> list[str]:
    """An Abort/AbortAck's `links` as a list of names, or `ProtocolError` naming `what`."""
    if not isinstance(links, list) or len(links) > MAX_LINKS or not all(
            isinstance(name, str) and len(name) <= 256 for name in links):
        raise ProtocolError(f"{what}: links must be at most {MAX_LINKS} names of at most 256 "
                            f"characters, got {links!r:.200}")
    return links


def landed_payload(request: str, xid: int, chunk: int, part: int, parts: int, last: bool,
                   nbytes: int, segments: int, span: int = 0, lo: int = 0, hi: int = 0) -> bytes:
    """`encode_notify(Landed(...))`, built without the dataclass: this runs once per transfer.

    The generic path costs ~3 us (dataclass construction, field reflection);
    this one a third of that. `tests/pdxfer/test_protocol.py` pins the two
    byte-for-byte, so the envelope is still decided by `transport.wire` alone.
    """
    # msgpack.packb, not a shared Packer: a Packer's buffer is not thread-safe.
    return _LANDED_HEAD + msgpack.packb({
        "request": request, "xid": xid, "chunk": chunk, "part": part, "parts": parts,
        "last": last, "nbytes": nbytes, "segments": segments, "span": span, "lo": lo,
        "hi": hi}, use_bin_type=True)


# The envelope up to the body, identical for every Landed: a 4-entry map, then
# p, v, t and the key "b" — packed once (msgpack writes a map's pairs in order).
_LANDED_HEAD = msgpack.packb({"p": CONTROL.name, "v": CONTROL.version, "t": "landed", "b": None},
                             use_bin_type=True)[:-1]
