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

Canonical encoding: msgpack of the dict with keys sorted at every level,
tuples as lists, floats as float64. That is a function of the values alone,
so equal declarations hash equal in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from .arenas import EntryMajorArena, LayerMajorArena, SplitEntryMajorArena
from .errors import LayoutError
from .fields import EntryField
from .per_layer import PerLayerArena
from .segments import Arena, _unknown

# Bump when the meaning of a description (or the arithmetic behind it) changes,
# so a peer running other layout code cannot match by accident.
FORMAT_VERSION = 1

# Not part of the format: a decode pool may be larger than the prefill pool.
_NOT_FORMAT = ("entries", "live_entries")

# Field attributes in the order `describe_diff` reports them.
_FIELD_ATTRS = ("name", "layers", "shape", "dtype", "fill", "align", "in_checkpoint")


def _describe_field(field: EntryField) -> dict[str, Any]:
    fill = float(field.fill)
    return {
        "name": field.name,
        "layers": field.layers,
        "shape": list(field.shape),
        "dtype": str(field.dtype),
        # One NaN, so the hash does not depend on a payload nobody chose.
        "fill": math.nan if math.isnan(fill) else fill,
        "align": field.align,
        "in_checkpoint": field.in_checkpoint,
    }


def describe(arena: Arena) -> dict[str, Any]:
    """Everything a peer needs to agree on an arena's bytes, as a plain dict."""
    if isinstance(arena, SplitEntryMajorArena):
        planes = [
            {
                "fields": [f.name for f in plane.fields],
                "entry_bytes": plane.entry_bytes,
                "slot_stride": plane.slot_stride,
            }
            for plane in arena.arenas
        ]
        stride = None  # one per plane, in `planes`
    elif isinstance(arena, (EntryMajorArena, LayerMajorArena, PerLayerArena)):
        stride = getattr(arena, "slot_stride", None)  # layer-major and per-layer have none
    else:
        raise _unknown(arena)
    desc: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "kind": arena.kind,
        "fields": [_describe_field(f) for f in arena.fields],
        "entries": arena.entries,
        "live_entries": arena.live_entries,
        "entry_bytes": arena.entry_bytes,
        "slot_stride": stride,
        "offsets": {f.name: arena.field_offset(f.name) for f in arena.fields},
    }
    if isinstance(arena, SplitEntryMajorArena):
        desc["planes"] = planes
    geometry = getattr(arena, "geometry", None)
    if geometry is not None:
        desc["page"] = dict(geometry)
    return desc


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


def _first_diff(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """`(path, a_value, b_value)` of the first difference inside two values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}" if path else key, a.get(key, "missing"), b.get(
                    key, "missing"
                )
            found = _first_diff(a[key], b[key], f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if _same(a, b) else (path, a, b)


def describe_diff(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """One sentence naming the first format difference between two descriptions, or None.

    E.g. `field 'score_state' differs in fill: -inf vs 0.0`. None exactly
    when the fingerprints are equal; `entries` and `live_entries` are not
    compared, as `fingerprint` does not hash them.
    """
    for key in ("version", "kind"):
        if not _same(a.get(key), b.get(key)):
            return f"{key} differs: {_show(a.get(key))} vs {_show(b.get(key))}"
    fa, fb = a.get("fields") or [], b.get("fields") or []
    names_a = [f.get("name") if isinstance(f, dict) else f for f in fa]
    names_b = [f.get("name") if isinstance(f, dict) else f for f in fb]
    if len(fa) != len(fb):
        return f"field count differs: {len(fa)} vs {len(fb)} ({names_a} vs {names_b})"
    for i, (x, y) in enumerate(zip(fa, fb, strict=True)):
        if not (isinstance(x, dict) and isinstance(y, dict)):
            if not _same(x, y):
                return f"field {i} differs: {_show(x)} vs {_show(y)}"
            continue
        extra = sorted((set(x) | set(y)) - set(_FIELD_ATTRS))
        for attr in _FIELD_ATTRS + tuple(extra):
            va, vb = x.get(attr, "missing"), y.get(attr, "missing")
            if not _same(va, vb):
                if attr == "name":
                    return f"field {i} differs in name: {va!r} vs {vb!r}"
                return f"field {x.get('name')!r} differs in {attr}: {_show(va)} vs {_show(vb)}"
    rest_a = {k: v for k, v in a.items() if k not in _NOT_FORMAT + ("version", "kind", "fields")}
    rest_b = {k: v for k, v in b.items() if k not in _NOT_FORMAT + ("version", "kind", "fields")}
    found = _first_diff(rest_a, rest_b, "")
    if found:
        path, va, vb = found
        top, _, inner = path.partition(".")
        if inner:
            return f"{top} differs in {inner}: {_show(va)} vs {_show(vb)}"
        return f"{path} differs: {_show(va)} vs {_show(vb)}"
    return None
