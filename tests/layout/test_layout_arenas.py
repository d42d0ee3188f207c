"""Arenas: every view aliases exactly its bytes, fills land only where they may."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST, field_bytes, field_lists, pattern
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    LayoutError,
    SplitEntryMajorArena,
    carve,
    carve_layer_major,
    entry_bytes_for,
    plan_field_planes,
    plan_regions,
)

CANARY = 0xA5


@st.composite
def entry_major_setups(draw: st.DrawFn) -> tuple[list[EntryField], int, int, int]:
    fields = draw(field_lists())
    entries = draw(st.integers(0, 4))
    strictest = max([256] + [f.align for f in fields])
    stride = entry_bytes_for(fields) + strictest * draw(st.integers(0, 2))
    live = draw(st.integers(0, entries))
    return fields, entries, stride, live


def _expected_entry_major(arena: EntryMajorArena, values: dict, size: int) -> torch.Tensor:
    """The buffer by hand: canary everywhere, `values[name][l, i]` at each field's bytes."""
    want = torch.full((size,), CANARY, dtype=torch.uint8)
    for f in arena.fields:
        for i in range(arena.entries):
            for layer in range(f.layers):
                start = i * arena.slot_stride + arena.field_offset(f.name) + layer * f.per_layer_bytes
                if name_values := values.get(f.name):
                    if i in name_values[1]:
                        want[start : start + f.per_layer_bytes] = field_bytes(f, name_values[0], layer, i)
    return want


@FAST
@given(entry_major_setups(), st.integers(0, 40))
def test_fills_only_live_entries_of_a_carved_buffer(setup, tail_words: int) -> None:
    fields, entries, stride, live = setup
    tail = 8 * tail_words  # whole elements of every dtype: a ragged tail is refused
    arena0 = EntryMajorArena(fields, entries, "cpu", slot_stride=stride, live_entries=live)
    size = arena0.total_bytes + tail
    buf = torch.full((size,), CANARY, dtype=torch.uint8)
    arena = EntryMajorArena(fields, entries, "cpu", buf=buf, slot_stride=stride, live_entries=live,
                            fill=True)
    assert arena.buf is buf
    fills = {
        f.name: (torch.full((f.layers, entries, *f.shape), f.fill, dtype=f.dtype),
                 set(range(entries - live, entries)))
        for f in fields
    }
    assert torch.equal(buf, _expected_entry_major(arena, fills, size))


@FAST
@given(entry_major_setups(), st.integers(0, 2**31))
def test_views_alias_exactly_their_bytes_inside_the_entry(setup, seed: int) -> None:
    fields, entries, stride, _ = setup
    arena = EntryMajorArena(fields, entries, "cpu", slot_stride=stride)
    for f in fields:
        arena.buf.fill_(CANARY)
        values = pattern((f.layers, entries, *f.shape), f.dtype, seed)
        arena.view(f.name).copy_(values)
        want = _expected_entry_major(arena, {f.name: (values, set(range(entries)))}, arena.buf.numel())
        assert torch.equal(arena.buf, want), f.name
        assert torch.equal(arena.view(f.name), values)
    for i in range(entries):
        e = arena.entry(i)
        assert e.numel() == arena.entry_bytes
        assert e.data_ptr() == arena.buf.data_ptr() + i * stride or not e.numel()
        for f in fields:
            assert arena.field_offset(f.name) + f.bytes_per_entry <= arena.entry_bytes


@FAST
@given(field_lists(min_size=1), st.integers(0, 4), st.integers(0, 2**31))
def test_layer_major_views_alias_their_bytes_and_fill(fields, entries: int, seed: int) -> None:
    arena = LayerMajorArena(fields, entries, "cpu")
    assert arena.total_bytes == arena.entry_bytes * entries
    for f in fields:
        assert torch.equal(
            arena.view(f.name), torch.full((f.layers, entries, *f.shape), f.fill, dtype=f.dtype)
        )
    for f in fields:
        arena.buf.fill_(CANARY)
        values = pattern((f.layers, entries, *f.shape), f.dtype, seed)
        arena.view(f.name).copy_(values)
        want = torch.full_like(arena.buf, CANARY)
        for layer in range(f.layers):
            for i in range(entries):
                start = arena.field_offset(f.name) * entries + (layer * entries + i) * f.per_layer_bytes
                want[start : start + f.per_layer_bytes] = field_bytes(f, values, layer, i)
        assert torch.equal(arena.buf, want), f.name


def test_owned_arena_fills_every_entry() -> None:
    score = EntryField("score", 2, (3,), torch.float32, fill=float("-inf"))
    arena = EntryMajorArena([EntryField("kv", 2, (3,), torch.bfloat16), score], 3, "cpu")
    assert torch.isneginf(arena.view("score")).all()
    assert (arena.view("kv") == 0).all()


def test_align_512_field_works_without_a_slot_stride() -> None:
    fields = [EntryField("a", 1, (3,), torch.float32), EntryField("w", 1, (8,), torch.float16, align=512)]
    arena = EntryMajorArena(fields, 3, "cpu")
    assert arena.entry_bytes == arena.slot_stride == 1024
    for i in range(3):
        assert (i * arena.slot_stride + arena.field_offset("w")) % 512 == 0


def test_total_bytes_is_never_negative() -> None:
    f = [EntryField("a", 1, (3,), torch.float32)]
    assert EntryMajorArena(f, 0, "cpu").total_bytes == 0
    assert EntryMajorArena(f, 0, "cpu", slot_stride=1024).total_bytes == 0
    assert LayerMajorArena(f, 0, "cpu").total_bytes == 0
    assert EntryMajorArena([], 4, "cpu").total_bytes == 0


def test_carve_layer_major_places_groups_on_their_strictest_alignment() -> None:
    small = [EntryField("scale", 1, (4,), torch.float32)]
    wide = [EntryField("rows", 1, (16,), torch.float16, align=512)]
    sizes = [entry_bytes_for(small), entry_bytes_for(wide)]
    naive, _ = plan_regions(sizes)
    assert naive[1] % 512  # an unaligned placement would be off the 512 B boundary
    offsets, total = plan_regions(sizes, [256, 512])
    buf = torch.zeros(total, dtype=torch.uint8)
    a, b, none = carve_layer_major([small, wide, []], 1, "cpu", buf=buf)
    assert none is None
    assert b.buf.storage_offset() == offsets[1] and offsets[1] % 512 == 0
    b.view("rows").fill_(2.0)
    assert a.view("scale").eq(0).all()
    owned = carve_layer_major([small, wide], 3, "cpu")
    assert [x.entries for x in owned] == [3, 3]


def test_split_arena_finds_fields_in_their_planes() -> None:
    fields = [
        EntryField("kv", 2, (64,), torch.float32),
        EntryField("score", 2, (64,), torch.float32, fill=float("-inf")),
        EntryField("idx", 1, (16,), torch.float16),
    ]
    widths = [512, 256]
    groups, rows = plan_field_planes(fields, widths)
    entries = 3
    planes = []
    for group, width in zip(groups, widths, strict=True):
        stride = rows * width
        planes.append(EntryMajorArena(group, entries, "cpu", buf=torch.zeros(entries * stride,
                      dtype=torch.uint8), slot_stride=stride, fill=True))
    split = SplitEntryMajorArena(planes)
    assert split.entry_bytes == sum(p.entry_bytes for p in planes)
    assert [f.name for f in split.fields] == [f.name for g in groups for f in g]
    for f in fields:
        plane = planes[split.plane_of(f.name)]
        assert split.view(f.name).data_ptr() == plane.view(f.name).data_ptr()
        assert split.field_offset(f.name) == plane.field_offset(f.name)
    assert torch.isneginf(split.view("score")).all()


def test_split_arena_refusals() -> None:
    a = EntryMajorArena([EntryField("x", 1, (4,), torch.float32)], 2, "cpu")
    with pytest.raises(LayoutError, match="at least one plane"):
        SplitEntryMajorArena([])
    with pytest.raises(LayoutError, match="field 'x' is in two planes"):
        SplitEntryMajorArena([a, EntryMajorArena([EntryField("x", 1, (4,), torch.float32)], 2, "cpu")])
    with pytest.raises(LayoutError, match="plane 1 has 3 entries .* plane 0 has 2"):
        SplitEntryMajorArena([a, EntryMajorArena([EntryField("y", 1, (4,), torch.float32)], 3, "cpu")])
    with pytest.raises(LayoutError, match="no field 'nope' in this split arena"):
        SplitEntryMajorArena([a]).view("nope")


F32 = [EntryField("a", 1, (3,), torch.float32)]
A512 = [EntryField("a", 1, (3,), torch.float32, align=512)]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: EntryMajorArena(F32, 2, "cpu", slot_stride=128), "slot stride 128 is under the 256 B"),
        (lambda: EntryMajorArena(A512, 2, "cpu", slot_stride=768), "slot stride 768 must be a multiple of 512"),
        (lambda: EntryMajorArena(F32, 2, "cpu", live_entries=3), r"live_entries 3 outside 0\.\.2"),
        (lambda: EntryMajorArena(F32, -1, "cpu"), "entries must be an integer >= 0, got -1"),
        (lambda: EntryMajorArena(F32, 2, "cpu", buf=torch.zeros(300, dtype=torch.uint8)),
         r"buf holds 300 B but 2 entries need at least 512 B: an entry is 256 B = 12 B of fields "
         r"\+ 244 B of alignment padding .* or entries=1 to fit this one"),
        (lambda: EntryMajorArena(F32, 2, "cpu", buf=torch.zeros(512, dtype=torch.int8)),
         "1-D uint8 tensor of at least 512 B"),
        (lambda: EntryMajorArena(F32, 2, "cpu", buf=torch.zeros(2048, dtype=torch.uint8)[::2]),
         "buf must be contiguous"),
        (lambda: EntryMajorArena(F32, 2, "cpu", buf=torch.zeros(1024, dtype=torch.uint8)[4:]),
         "start on a 256 B boundary, got storage offset 4"),
        (lambda: EntryMajorArena(F32, 2, "cpu", buf=torch.zeros(513, dtype=torch.uint8)),
         r"buffer size 513 B is not a multiple of 4"),
        (lambda: EntryMajorArena(F32 + F32, 2, "cpu"), r"duplicate field names \['a'\]"),
        (lambda: EntryMajorArena(F32, 2, "cpu").entry(2), r"entry index 2 outside 0\.\.1"),
        (lambda: EntryMajorArena(F32, 2, "cpu").view("b"), r"no field 'b' in this arena; it has \['a'\]"),
        (lambda: LayerMajorArena([], 2, "cpu"), "needs at least one field"),
        (lambda: LayerMajorArena(F32, 2, "cpu", buf=torch.zeros(100, dtype=torch.uint8)),
         "at least 512 B"),
        (lambda: LayerMajorArena(F32, 2, "cpu", buf=torch.zeros(514, dtype=torch.uint8)),
         r"buffer size 514 B is not a multiple of 4"),
        (lambda: LayerMajorArena([EntryField("s", 1, (2,), torch.float32, fill=float("-inf"))], 2, "cpu",
                                 buf=torch.zeros(512, dtype=torch.uint8)),
         r"fields \['s'\] declare a non-zero fill"),
        (lambda: carve_layer_major([F32], 2, "cpu", buf=torch.zeros(100, dtype=torch.uint8)),
         "buffer of 100 B cannot hold 1 regions needing 512 B"),
    ],
)
def test_arena_refusals(build, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        build()


def test_refusals_are_value_errors_and_write_nothing() -> None:
    buf = torch.full((1024,), CANARY, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot stride 128"):
        EntryMajorArena(F32, 2, "cpu", buf=buf, slot_stride=128)
    assert (buf == CANARY).all()


def test_carved_regions_do_not_bleed_into_each_other() -> None:
    fields = [EntryField("kv", 2, (5,), torch.float32, fill=1.0)]
    size = EntryMajorArena(fields, 3, "meta").total_bytes
    offsets, total = plan_regions([size, size])
    buf = torch.zeros(total + 256, dtype=torch.uint8)
    first, second = carve(buf, [size, size])
    a = EntryMajorArena(fields, 3, "cpu", buf=first, fill=True)
    b = EntryMajorArena(fields, 3, "cpu", buf=second, fill=True)
    a.view("kv").fill_(7.0)
    assert (b.view("kv") == 1.0).all()
    assert (buf[total:] == 0).all()


def test_numpy_integers_count_as_integers() -> None:
    arena = EntryMajorArena(F32, np.int64(3), "cpu", live_entries=np.int32(2))
    assert arena.entries == 3 and arena.entry(np.int64(2)).numel() == 256
    with pytest.raises(LayoutError, match=r"entry index True outside"):
        arena.entry(True)


@FAST
@given(entry_major_setups(), st.booleans())
def test_wrapping_a_callers_buffer_changes_none_of_its_bytes(setup, owned_fill_off: bool) -> None:
    """The engine's tensor is the caller's: building an arena over it writes nothing."""
    fields, entries, stride, live = setup
    size = EntryMajorArena(fields, entries, "meta", slot_stride=stride).total_bytes
    buf = torch.full((size,), CANARY, dtype=torch.uint8)
    try:  # declared fills make `fill` a required choice; either way nothing is written
        EntryMajorArena(fields, entries, "cpu", buf=buf, slot_stride=stride, live_entries=live)
    except LayoutError:
        assert any(f.fill for f in fields)
    EntryMajorArena(fields, entries, "cpu", buf=buf, slot_stride=stride, fill=False)
    assert torch.equal(buf, torch.full_like(buf, CANARY))
    if owned_fill_off:  # fill=False on an owned buffer: zeroed, declared fills skipped
        own = EntryMajorArena(fields, entries, "cpu", slot_stride=stride, fill=False)
        assert not own.buf.any()


def test_padding_is_spelled_out_when_the_buffer_is_short() -> None:
    # 150 float32 = 600 B of fields; the entry rounds up to 768 B on a 256 B boundary.
    fields = [EntryField("a", 1, (150,), torch.float32)]
    with pytest.raises(LayoutError, match=(
            r"buf holds 2400 B but 4 entries need at least 3072 B: an entry is 768 B = 600 B of "
            r"fields \+ 168 B of alignment padding \(fields start on and the entry rounds up to "
            r"256 B\); pass a buffer of at least 3072 B, or entries=3 to fit this one")):
        EntryMajorArena(fields, 4, "cpu", buf=torch.zeros(2400, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="1024 B of slot gap"):
        EntryMajorArena(fields, 4, "cpu", buf=torch.zeros(2400, dtype=torch.uint8), slot_stride=1792)
    with pytest.raises(LayoutError, match="fill must be True, False or None"):
        EntryMajorArena(fields, 4, "cpu", fill=1)


def test_a_callers_buffer_with_declared_fills_needs_fill_said() -> None:
    """A `-inf` score left at 0.0 turns "never selected" into "always": say which you mean."""
    fields = [EntryField("kv", 1, (4,), torch.float32),
              EntryField("score", 1, (4,), torch.float32, fill=float("-inf"))]
    buf = torch.full((2 * 512,), CANARY, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=(
            r"fields \['score'\] declare a non-zero fill .* pass fill=True to write it into the "
            r"live entries .* or fill=False to leave the buffer as it is")):
        EntryMajorArena(fields, 2, "cpu", buf=buf)
    assert (buf == CANARY).all()
    assert torch.isneginf(EntryMajorArena(fields, 2, "cpu", buf=buf, fill=True).view("score")).all()
    EntryMajorArena(fields, 2, "cpu", buf=buf, fill=False)
    EntryMajorArena(fields[:1], 2, "cpu", buf=buf)  # no fill declared: nothing to decide
