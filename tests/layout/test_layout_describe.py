"""Descriptions: plain data, a stable format hash, and a diff that names the field."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST, field_lists
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    LayoutError,
    PageMajorMambaArena,
    PageMajorMHAArena,
    SplitEntryMajorArena,
    describe,
    describe_diff,
    fingerprint,
)

ROOT = Path(__file__).resolve().parents[2]


def pool_fields() -> list[EntryField]:
    return [
        EntryField("kv_state", 2, (4, 8), torch.float32),
        EntryField("score_state", 2, (4, 8), torch.float32, fill=float("-inf")),
        EntryField("ring", 1, (16,), torch.bfloat16, align=512, in_checkpoint=False),
    ]


def all_kinds() -> list:
    f = pool_fields()
    return [
        EntryMajorArena(f, 3, "meta", live_entries=2),
        LayerMajorArena(f, 3, "meta"),
        SplitEntryMajorArena([EntryMajorArena(f[:2], 3, "meta"), EntryMajorArena(f[2:], 3, "meta")]),
        PageMajorMHAArena(2, 2, 4, 4, torch.float16, 4, 3, "meta"),
        PageMajorMambaArena(2, [(3, 4)], torch.float16, (2, 2), torch.float32, 3, "meta"),
    ]


@pytest.mark.parametrize("arena", all_kinds(), ids=lambda a: a.kind)
def test_description_is_plain_data_that_survives_msgpack(arena) -> None:
    desc = describe(arena)
    for key in ("kind", "fields", "entries", "live_entries", "entry_bytes", "slot_stride", "offsets"):
        assert key in desc
    back = msgpack.unpackb(msgpack.packb(desc, use_bin_type=True), raw=False)
    assert back == desc
    assert fingerprint(back) == fingerprint(desc)
    assert describe_diff(back, desc) is None
    assert [f["name"] for f in desc["fields"]] == [f.name for f in arena.fields]


def test_minus_inf_fill_survives_the_wire() -> None:
    desc = describe(EntryMajorArena(pool_fields(), 2, "meta"))
    back = msgpack.unpackb(msgpack.packb(desc))
    assert back["fields"][1]["fill"] == float("-inf")
    assert back["fields"][1]["dtype"] == "torch.float32"


def test_entry_counts_are_not_part_of_the_format() -> None:
    prefill = EntryMajorArena(pool_fields(), 4, "meta")
    decode = EntryMajorArena(pool_fields(), 40, "meta", live_entries=10)
    assert describe(prefill) != describe(decode)
    assert fingerprint(describe(prefill)) == fingerprint(describe(decode))
    assert describe_diff(describe(prefill), describe(decode)) is None


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "import torch\nfrom pdxfer import layout\n"
        "from test_layout_describe import pool_fields\n"
        "print(layout.fingerprint(layout.describe(layout.EntryMajorArena(pool_fields(), 5, 'meta'))))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    here = fingerprint(describe(EntryMajorArena(pool_fields(), 7, "meta")))
    assert out.stdout.strip() == here
    assert len(here) == 64 and int(here, 16) >= 0


MUTATIONS = {
    "layers": lambda f: f.layers + 1,
    "shape": lambda f: (*f.shape, 2),
    "dtype": lambda f: torch.float64 if f.dtype is not torch.float64 else torch.float32,
    "fill": lambda f: float("-inf") if f.fill != float("-inf") else 0.0,
    "align": lambda f: 512 if f.align != 512 else 1024,
    "in_checkpoint": lambda f: not f.in_checkpoint,
}


@FAST
@given(field_lists(min_size=1), st.data())
def test_any_changed_attribute_changes_the_fingerprint_and_is_named(fields, data) -> None:
    i = data.draw(st.integers(0, len(fields) - 1))
    attr = data.draw(st.sampled_from(sorted(MUTATIONS)))
    if attr == "fill" and not fields[i].dtype.is_floating_point:
        attr = "layers"
    changed = list(fields)
    changed[i] = dataclasses.replace(fields[i], **{attr: MUTATIONS[attr](fields[i])})
    a = describe(EntryMajorArena(fields, 2, "meta"))
    b = describe(EntryMajorArena(changed, 2, "meta"))
    assert fingerprint(a) != fingerprint(b)
    assert describe_diff(a, b).startswith(f"field {fields[i].name!r} differs in {attr}: ")
    # Same declaration, rebuilt: same hash.
    assert fingerprint(describe(EntryMajorArena(list(fields), 5, "meta"))) == fingerprint(a)


def test_diff_sentences() -> None:
    f = pool_fields()
    base = describe(EntryMajorArena(f, 2, "meta"))
    zero = [f[0], dataclasses.replace(f[1], fill=0.0), f[2]]
    assert describe_diff(base, describe(EntryMajorArena(zero, 2, "meta"))) == (
        "field 'score_state' differs in fill: -inf vs 0.0"
    )
    half = [f[0], dataclasses.replace(f[1], dtype=torch.bfloat16), f[2]]
    assert describe_diff(base, describe(EntryMajorArena(half, 2, "meta"))) == (
        "field 'score_state' differs in dtype: torch.float32 vs torch.bfloat16"
    )
    renamed = [f[0], dataclasses.replace(f[1], name="scores"), f[2]]
    assert describe_diff(base, describe(EntryMajorArena(renamed, 2, "meta"))) == (
        "field 1 differs in name: 'score_state' vs 'scores'"
    )
    assert describe_diff(base, describe(EntryMajorArena(f[:2], 2, "meta"))).startswith(
        "field count differs: 3 vs 2"
    )
    assert describe_diff(base, describe(LayerMajorArena(f, 2, "meta"))) == (
        "kind differs: entry_major vs layer_major"
    )
    wide = describe(EntryMajorArena(f, 2, "meta", slot_stride=2048))
    assert describe_diff(base, wide) == "slot_stride differs: 1024 vs 2048"
    p16 = describe(PageMajorMHAArena(2, 2, 4, 4, torch.float16, 4, 3, "meta"))
    page = dict(p16, page=dict(p16["page"], head_num=3))
    assert describe_diff(p16, page) == "page differs in head_num: 2 vs 3"
    assert fingerprint(p16) != fingerprint(page)


def test_fingerprint_refuses_what_is_not_a_description() -> None:
    with pytest.raises(LayoutError, match="a description is a dict"):
        fingerprint([1, 2])
    with pytest.raises(LayoutError, match=r"desc.extra holds a set"):
        fingerprint({"kind": "entry_major", "extra": {1}})
    with pytest.raises(LayoutError, match="not an arena layout knows"):
        describe(object())


def test_description_is_json_friendly_too() -> None:
    # Plain data through and through: JSON (with -inf allowed) needs nothing custom.
    for arena in all_kinds():
        desc = describe(arena)
        back = json.loads(json.dumps(desc))
        assert fingerprint(back) == fingerprint(desc)
