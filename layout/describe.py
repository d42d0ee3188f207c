"""What a peer must agree on before bytes move: an arena's description and its hash.

`describe` turns an arena into a plain dict (msgpack-able: str keys, ints,
floats, strings, lists, None) holding every fact that decides where a byte
lives: the fields with all their attributes (dtype by name, `fill` as a float,
`-inf` included), entry size, stride, offsets, and per-kind extras (planes of
a split arena, page geometry of SGLang's pools). `fingerprint` hashes the
canonical encoding of the *format*: everything except `entries` and
`live_entries`, which legitimately differ between a prefill and a decode pool
of one model. `describe_diff` says in one sentence what the first difference
is, so a handshake refusal names the field and attribute instead of two
hashes.

A shard-major arena (`layout.shards`) is described by its GLOBAL format
(the unsharded fields, `tp_axis` included, and the head-group size) plus its
TP size and rank and what that split places. Two ranks of different splits
differ in fingerprint yet may exchange bytes: `describe_diff` compares their
global formats and checks each split against its own (`split_of`), and
returns None when they are compatible (`is_split_pair` says it is that case).

Canonical encoding: msgpack of the dict with keys sorted at every level,
tuples as lists, floats as float64. That is a function of the values alone,
so equal declarations hash equal in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

import msgpack
import torch

from .errors import LayoutError
from .fields import EntryField, field_extents, strictest_align
from .protocol import FORMAT_VERSION
from .segments import Arena, _known
from .shards import ShardGeometry, ShardMajorArena, shard_geometry

__all__ = ["FORMAT_VERSION", "describe", "describe_diff", "fingerprint", "is_split_pair",
           "split_of"]

# Not part of the format: a decode pool may be larger than the prefill pool.
_NOT_FORMAT = ("entries", "live_entries")

# Field attributes in the order `describe_diff` reports them.
_FIELD_ATTRS = ("name", "layers", "shape", "dtype", "fill", "align", "in_checkpoint")

# A shard-major description's facts that follow from (global format, TP size,
# rank): they differ between the ranks of two compatible splits and are
# checked against the global format by `split_of` instead of compared.
_SHARD_LOCAL = ("tp", "entry_bytes", "slot_stride", "offsets")


def describe(arena: Arena) -> dict[str, Any]:
    """Everything a peer needs to agree on an arena's bytes, as a plain dict.

    Each kind says it itself (`Arena.description`); this only refuses what
    is not an arena.
    """
    return _known(arena).description()


def _canonical(value: Any, path: str = "desc") -> Any:
    """`value` with dict keys sorted and only msgpack's plain types left."""
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise LayoutError(f"{path} has a non-string key {key!r}")
        return {key: _canonical(value[key], f"{path}.{key}") for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return math.nan if math.isnan(value) else float(value)
    raise LayoutError(
        f"{path} holds a {type(value).__name__}, which a description cannot; "
        "descriptions carry only str, int, float, bool, None, lists and dicts"
    )


def _format_bytes(desc: dict[str, Any]) -> bytes:
    if not isinstance(desc, dict):
        raise LayoutError(f"a description is a dict (see describe), got {type(desc).__name__}")
    fmt = {k: v for k, v in desc.items() if k not in _NOT_FORMAT}
    return msgpack.packb(_canonical(fmt), use_bin_type=True)


def fingerprint(desc: dict[str, Any]) -> str:
    """Stable sha256 hex digest of a description's format (not its entry counts).

    Two arenas built from the same declaration, in any process on any
    machine, give the same digest; any field attribute, stride or offset
    that differs gives another.
    """
    return hashlib.sha256(_format_bytes(desc)).hexdigest()


def _show(value: Any) -> str:
    return str(value) if not isinstance(value, dict) else str(_canonical(value))


def _same(a: Any, b: Any) -> bool:
    try:
        return msgpack.packb(_canonical(a)) == msgpack.packb(_canonical(b))
    except LayoutError:
        return a == b


def _diffs(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """`(path, a_value, b_value)` of each difference inside two values, in a fixed order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                yield f"{path}.{key}" if path else key, a.get(key, "missing"), b.get(key, "missing")
                continue
            yield from _diffs(a[key], b[key], f"{path}.{key}" if path else key)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _diffs(x, y, f"{path}[{i}]")
        return
    if not _same(a, b):
        yield path, a, b


def describe_diff(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """One sentence naming the first format difference between two descriptions, or None.

    E.g. `field 'score_state' differs in fill: -inf vs 0.0`. None when the
    fingerprints are equal; `entries` and `live_entries` are not compared, as
    `fingerprint` does not hash them. Also None for two shard-major
    descriptions at different TP splits of one global format, each split
    valid (`is_split_pair` tells that case apart): they exchange bytes
    through `layout.tp_plan`, so a handshake accepts them. The first of
    `describe_diffs`.
    """
    return next(_describe_diffs(a, b), None)


def describe_diffs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every format difference between two descriptions, in `describe_diff`'s words.

    The first is `describe_diff`'s. A differing `version` or `kind` is all
    that is said (another kind's fields mean other things); fields are
    paired by position, and a field whose name differs is named once, not
    attribute by attribute. Empty when the formats agree.
    """
    return list(_describe_diffs(a, b))


def _describe_diffs(a: dict[str, Any], b: dict[str, Any]) -> Iterator[str]:
    if (isinstance(a, dict) and isinstance(b, dict) and a.get("kind") == b.get("kind")
            == ShardMajorArena.kind and not _same(a.get("tp"), b.get("tp"))):
        found = _split_diff(a, b)
        if found is not None:
            yield found
        return
    kinds = [f"{key} differs: {_show(a.get(key))} vs {_show(b.get(key))}"
             for key in ("version", "kind") if not _same(a.get(key), b.get(key))]
    if kinds:
        yield from kinds
        return
    fa, fb = a.get("fields") or [], b.get("fields") or []
    names_a = [f.get("name") if isinstance(f, dict) else f for f in fa]
    names_b = [f.get("name") if isinstance(f, dict) else f for f in fb]
    if len(fa) != len(fb):
        yield f"field count differs: {len(fa)} vs {len(fb)} ({names_a} vs {names_b})"
    for i, (x, y) in enumerate(zip(fa, fb)):  # noqa: B905 — a count difference is named above
        if not (isinstance(x, dict) and isinstance(y, dict)):
            if not _same(x, y):
                yield f"field {i} differs: {_show(x)} vs {_show(y)}"
            continue
        if len(fa) != len(fb) and not _same(x.get("name"), y.get("name")):
            continue  # the count difference already lists both sides' names
        extra = sorted((set(x) | set(y)) - set(_FIELD_ATTRS))
        for attr in _FIELD_ATTRS + tuple(extra):
            va, vb = x.get(attr, "missing"), y.get(attr, "missing")
            if not _same(va, vb):
                if attr == "name":
                    yield f"field {i} differs in name: {va!r} vs {vb!r}"
                    break  # another field: its other attributes say nothing more
                yield f"field {x.get('name')!r} differs in {attr}: {_show(va)} vs {_show(vb)}"
    rest_a = {k: v for k, v in a.items() if k not in _NOT_FORMAT + ("version", "kind", "fields")}
    rest_b = {k: v for k, v in b.items() if k not in _NOT_FORMAT + ("version", "kind", "fields")}
    for path, va, vb in _diffs(rest_a, rest_b, ""):
        top, _, inner = path.partition(".")
        if inner:
            yield f"{top} differs in {inner}: {_show(va)} vs {_show(vb)}"
        else:
            yield f"{path} differs: {_show(va)} vs {_show(vb)}"


def _split_diff(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The global formats compared, then each split checked against its own."""
    found = describe_diff(*({k: v for k, v in d.items() if k not in _SHARD_LOCAL} for d in (a, b)))
    if found is not None:
        return found
    for desc in (a, b):
        try:
            split_of(desc)
        except LayoutError as exc:
            return f"TP split {_show(desc.get('tp'))} refused: {exc}"
    return None


def is_split_pair(a: Any, b: Any) -> bool:
    """Whether two descriptions are shard-major at different TP splits.

    Why: such a pair has different fingerprints yet may exchange bytes, so a
    handshake asks `describe_diff` (None: compatible) and this (the pair needs
    rank-pair planning, `layout.rank_pair`) instead of comparing hashes.
    """
    return (isinstance(a, dict) and isinstance(b, dict)
            and a.get("kind") == b.get("kind") == ShardMajorArena.kind
            and not _same(a.get("tp"), b.get("tp")))


def _field_from_desc(d: Any) -> EntryField:
    if not isinstance(d, dict):
        raise LayoutError(f"a described field is a dict, got {type(d).__name__}")
    dtype = getattr(torch, str(d.get("dtype", "")).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"field {d.get('name')!r} names no torch dtype: {d.get('dtype')!r}")
    try:
        return EntryField(d["name"], d["layers"], tuple(d["shape"]), dtype, d["fill"],
                          d["align"], d["in_checkpoint"], d.get("tp_axis"))
    except (KeyError, TypeError) as exc:
        raise LayoutError(f"field {d.get('name')!r} is malformed: missing or bad {exc}") from None


def split_of(desc: dict[str, Any]) -> tuple[ShardGeometry, int]:
    """`(geometry, slot_stride)` of a shard-major description, rebuilt from its global format.

    Why: a peer's claims about its local entry (size, offsets, stride) are
    only trusted where they equal what its global format and split give, so
    a planner never addresses bytes from a number the peer merely asserted.
    Refusals (`LayoutError`) name the field or the number that differs.
    """
    if not isinstance(desc, dict) or desc.get("kind") != ShardMajorArena.kind:
        raise LayoutError("not a shard-major description (see layout.describe)")
    tp = desc.get("tp")
    if not (isinstance(tp, dict) and type(tp.get("size")) is int and type(tp.get("rank")) is int):
        raise LayoutError(f"tp must be {{'size': int, 'rank': int}}, got {tp!r}")
    raw = desc.get("fields")
    if not isinstance(raw, list):
        raise LayoutError("fields must be a list")
    geometry = shard_geometry([_field_from_desc(f) for f in raw], tp["size"], tp["rank"])
    want = {
        "units": geometry.units,
        "unit_bytes": geometry.unit_bytes,
        "entry_bytes": geometry.entry_bytes,
        "offsets": {f.name: start for f, start, _ in field_extents(geometry.local)},
    }
    for key, value in want.items():
        if not _same(desc.get(key), value):
            raise LayoutError(f"{key} is {_show(desc.get(key))} but the split gives {_show(value)}")
    stride = desc.get("slot_stride")
    align = strictest_align(geometry.local)
    if type(stride) is not int or stride < geometry.entry_bytes or stride % align:
        raise LayoutError(
            f"slot_stride {stride!r} must be an int >= {geometry.entry_bytes} and a multiple of {align}"
        )
    return geometry, stride
