"""What the directory stores: where a rank sits (`Slot`) and how to reach it (`PeerRecord`).

A `Slot` is a place in the deployment — (model, role, instance, dp rank, tp
rank) — and is what a router or a decode resolves. A `PeerRecord` is the
process that holds the slot now: its control address (today's bootstrap
address), its transport engine id — the *incarnation*: a restarted process
in the same slot has a new one, and a Welcome must carry exactly it — its
transport, TP/DP sizes and `{pool: layout fingerprint}`, so a decode can refuse
a prefill whose pools differ before dialing it.

Values are JSON (an operator reads them with `etcdctl get --prefix`), carry
their format number (`RECORD_FORMAT`) and are decoded strictly: a value that
is not a record of this format is refused with the key named, never half-read.
Layout descriptions are not in the records: they are published once per
format, content-addressed by fingerprint (`layout.fingerprint`), so a
thousand ranks of one model store one description.

Deliberately absent: region descriptors (addresses, rkeys). They belong to
one incarnation's registration and travel in the live handshake; Mooncake's
stale `ram/` entries with old addresses are the cautionary tale.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdxfer import layout

from .errors import DirectoryError, RecordError

RECORD_FORMAT = 1
# A record is a few hundred bytes; a description a few KiB. Anything past
# these is not ours, and is refused before it is parsed.
MAX_RECORD = 64 << 10
MAX_LAYOUT = 1 << 20
# Nesting a value may have (a record is 3 deep, a description 5): checked
# before json parses it, whose recursion a 5,000-deep value would exhaust.
MAX_DEPTH = 32
# Every number a stored value carries is bounded (docs/directory.md, "What a
# record holds"): a size drives loops and lists in `group`/`instances`, so a
# record claiming tp_size 2**40 must be refused, not believed.
MAX_RANKS = 4096  # tp_size, dp_size (and a slot's tp, dp below them)
MAX_PROTOCOL = 65535
MAX_POOLS = 256
MAX_TEXT = 256  # address, engine id, transport, pool names, fingerprints
ROLES = ("prefill", "decode")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def check_name(what: str, value: object) -> str:
    """A key component (model, instance, cluster): non-empty, `[A-Za-z0-9._-]`, or `DirectoryError`."""
    if not isinstance(value, str) or not value or not set(value) <= _NAME_CHARS or value in (".", ".."):
        raise DirectoryError(f"{what} must be a non-empty name of letters, digits, '.', '_' or '-' "
                             f"(it becomes a key component), got {value!r}")
    return value


@dataclass(frozen=True, order=True)
class Slot:
    """Where one rank sits; the unit a decode resolves."""

    model: str
    role: str  # "prefill" | "decode"
    instance: str  # one prefill or decode server (what a router picks)
    dp: int = 0
    tp: int = 0

    def __post_init__(self) -> None:
        check_name("Slot.model", self.model)
        check_name("Slot.instance", self.instance)
        if self.role not in ROLES:
            raise DirectoryError(f"Slot.role must be one of {ROLES}, got {self.role!r}")
        for name in ("dp", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_RANKS:
                raise DirectoryError(f"Slot.{name} must be an int in 0..{MAX_RANKS - 1}, got {value!r}")

    def path(self) -> str:
        """The slot's key below a directory's root: `<model>/<role>/peers/<instance>/<dp>/<tp>`."""
        return f"{self.model}/{self.role}/peers/{self.instance}/{self.dp}/{self.tp}"

    @classmethod
    def from_path(cls, path: str) -> Slot:
        """The inverse of `path()`, or `RecordError` naming the key."""
        parts = path.split("/")
        # ASCII digits only: str.isdigit() also accepts '²', which int() then refuses
        if (len(parts) != 6 or parts[2] != "peers"
                or not all(p.isascii() and p.isdigit() and len(p) <= len(str(MAX_RANKS))
                           and (p == "0" or p[0] != "0") for p in parts[4:])):
            raise RecordError(f"key {path!r} is not <model>/<role>/peers/<instance>/<dp>/<tp> "
                              "(ranks in ASCII digits, no leading zeros)")
        try:
            return cls(parts[0], parts[1], parts[3], int(parts[4]), int(parts[5]))
        except DirectoryError as exc:
            raise RecordError(f"key {path!r}: {exc}") from exc


@dataclass(frozen=True)
class PeerRecord:
    """The process holding a slot now, as its registration describes it.

    `engine` is None only for a record built from a bare address (the static
    directory, today's call sites): then nothing is checked against it.
    """

    slot: Slot | None
    address: str  # control listener host:port (the prefill's bootstrap address)
    engine: str | None  # transport engine id: the incarnation a Welcome must name
    transport: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    layouts: Mapping[str, str] = field(default_factory=dict)  # pool -> layout fingerprint
    protocol: int | None = None  # pdxfer.protocol.VERSION of the registrant
    meta: Mapping[str, Any] = field(default_factory=dict)  # free-form (worker RPC address, pid, ...)

    @classmethod
    def at(cls, address: str) -> PeerRecord:
        """A record that knows only an address: today's behaviour, no checks."""
        return cls(None, address, None)

    def encode(self) -> bytes:
        """The stored value (JSON, with the format number)."""
        if self.slot is None or self.engine is None:
            raise DirectoryError("only a record with a slot and an engine id can be registered")
        return json.dumps({
            "format": RECORD_FORMAT, "address": self.address, "engine": self.engine,
            "transport": self.transport, "tp_size": self.tp_size, "dp_size": self.dp_size,
            "layouts": dict(self.layouts), "protocol": self.protocol, "meta": dict(self.meta),
        }, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, slot: Slot, value: bytes) -> PeerRecord:
        """A stored value back into a record, or `RecordError` saying what is wrong with it."""
        where = f"record for {slot.path()}"
        d = _load(where, value, MAX_RECORD)
        if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise RecordError(f"{where} has format {got!r}, this pdxfer reads {RECORD_FORMAT}; "
                              "upgrade the older side")
        problem = check_fields(d)
        if problem:
            raise RecordError(f"{where} is malformed: {problem}")
        if slot.tp >= d["tp_size"] or slot.dp >= d["dp_size"]:
            raise RecordError(f"{where}: rank (dp {slot.dp}, tp {slot.tp}) outside its own sizes "
                              f"(dp {d['dp_size']}, tp {d['tp_size']})")
        return cls(slot, d["address"], d["engine"], d["transport"], d["tp_size"], d["dp_size"],
                   d["layouts"], d["protocol"], d["meta"])


def check_fields(d: Mapping[str, Any]) -> str | None:
    """What is wrong with a record's fields (a stored or a registered one), or None.

    Every bound is checked here, once, for both directions: a registration is
    refused with what `decode` would refuse, so nothing is written that a peer
    could not read back.
    """
    def text(name: str, optional: bool = False) -> str | None:
        v = d.get(name)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not 0 < len(v) <= MAX_TEXT:
            return f"{name} must be a string of 1..{MAX_TEXT} characters, got {v!r:.80}"
        return None

    for name, optional in (("address", False), ("engine", False), ("transport", True)):
        if (problem := text(name, optional)) is not None:
            return problem
    if (problem := address_problem(d["address"])) is not None:
        return problem
    for name in ("tp_size", "dp_size"):
        v = d.get(name)
        if type(v) is not int or not 1 <= v <= MAX_RANKS:
            return f"{name} must be an int in 1..{MAX_RANKS}, got {v!r:.80}"
    protocol = d.get("protocol")
    if protocol is not None and (type(protocol) is not int or not 0 <= protocol <= MAX_PROTOCOL):
        return f"protocol must be null or an int in 0..{MAX_PROTOCOL}, got {protocol!r:.80}"
    layouts = d.get("layouts")
    if not isinstance(layouts, Mapping) or len(layouts) > MAX_POOLS:
        return (f"layouts must be an object of at most {MAX_POOLS} pool -> fingerprint, got "
                f"{type(layouts).__name__} of {len(layouts) if isinstance(layouts, Mapping) else '?'}")
    for k, v in layouts.items():
        if not all(isinstance(x, str) and 0 < len(x) <= MAX_TEXT for x in (k, v)):
            return f"layouts must map pool names to fingerprints (strings of 1..{MAX_TEXT}), got {k!r:.80}: {v!r:.80}"
    if not isinstance(d.get("meta"), Mapping):
        return f"meta must be an object, got {type(d.get('meta')).__name__}"
    return None


def address_problem(address: str) -> str | None:
    """Why `address` is not `host:port` (or `[v6]:port`) with a port 1..65535; None if it is."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        return f"address must be 'host:port' with a port 1..65535, got {address!r:.80}"
    return None


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """How deep `text`'s arrays and objects nest (strings skipped), without parsing it."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _load(where: str, value: bytes, limit: int) -> Any:
    """A stored JSON value, refused (`RecordError`, naming `where`) past `limit` bytes or `MAX_DEPTH`
    levels, or unparsable; never any other exception."""
    if len(value) > limit:
        raise RecordError(f"{where} is {len(value)} B, over the {limit} B limit")
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"{where} is not JSON: not UTF-8 ({exc})") from exc
    if (deep := _depth(text)) > MAX_DEPTH:
        raise RecordError(f"{where} nests {deep} levels deep, over the {MAX_DEPTH} limit")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"{where} is not JSON: {exc}") from exc


def describe_pools(pools: Mapping[str, Any]) -> dict[str, dict]:
    """`{pool: layout.describe(arena)}`: what a registrant publishes for its pools."""
    return {name: layout.describe(arena) for name, arena in pools.items()}


def engine_record(slot: Slot, engine: Any, pools: Mapping[str, Any], *, tp_size: int = 1,
                  dp_size: int = 1, meta: Mapping[str, Any] | None = None
                  ) -> tuple[PeerRecord, dict[str, dict]]:
    """The record of a prefill `engine` over `pools` in `slot`, and `{fingerprint: description}`.

    What `PeerDirectory.register` takes: the record, and the layouts to
    publish (content-addressed, once per format).
    """
    from pdxfer.protocol import VERSION  # here: records stay importable without the engine

    descs = describe_pools(pools)
    fps = {name: layout.fingerprint(d) for name, d in descs.items()}
    record = PeerRecord(slot, engine.bootstrap_address, engine.engine_id, engine.config.transport,
                        tp_size, dp_size, fps, VERSION, dict(meta or {}))
    return record, {fps[name]: d for name, d in descs.items()}


def encode_layout(desc: Mapping[str, Any]) -> bytes:
    """A layout description as stored (JSON)."""
    return json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()


def decode_layout(fingerprint: str, value: bytes) -> dict:
    """A stored description, checked against the fingerprint it is stored under."""
    desc = _load(f"layout {fingerprint}", value, MAX_LAYOUT)
    try:
        if layout.fingerprint(desc) != fingerprint:
            raise RecordError(f"layout stored under {fingerprint} has another fingerprint")
    except RecordError:
        raise
    except Exception as exc:  # noqa: BLE001 — whatever a hostile description trips (msgpack's
        # OverflowError on a huge int included) is that description's fault, named as such
        raise RecordError(f"layout {fingerprint} is not a layout description: {exc!r:.200}") from exc
    return desc
