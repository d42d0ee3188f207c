"""Layer-interleaved entries: offsets, views, layer ranges and plans against an oracle written here.

The oracle places one layer of every field by hand (align, place, advance)
and repeats it per layer; nothing below asks the arena where a byte is
before checking it against that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST, expand, field_bytes, field_lists, pattern
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerInterleavedArena,
    LayoutError,
    PageMajorMHAArena,
    arena_buffers,
    describe,
    describe_diff,
    fingerprint,
    plan_segments,
)


def oracle(fields: list[EntryField]) -> tuple[int, int, dict[tuple[str, int], tuple[int, int]]]:
    """`(layer_bytes, entry_bytes, {(field, layer): (start, nbytes)})`, by hand."""
    inner, offset = {}, 0
    for f in fields:
        align = max(256, f.align)
        offset = -(-offset // align) * align
        inner[f.name] = offset
        offset += math.prod(f.shape) * f.dtype.itemsize
    strictest = max([256] + [f.align for f in fields])
    layer = -(-offset // strictest) * strictest
    depth = max(f.layers for f in fields)
    where = {(f.name, k): (k * layer + inner[f.name], math.prod(f.shape) * f.dtype.itemsize)
             for f in fields for k in range(f.layers)}
    return layer, depth * layer, where


def owners(fields: list[EntryField], entry_bytes: int, where: dict) -> np.ndarray:
    """Per byte of an entry: index into `keys` of the (field, layer) owning it, -1 for padding."""
    own = np.full(entry_bytes, -1, dtype=np.int64)
    for k, (start, n) in enumerate(where.values()):
        assert (own[start:start + n] == -1).all(), "oracle placed two pieces on one byte"
        own[start:start + n] = k
    return own


def covered(ranges: list[tuple[int, int]], size: int) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    for off, n in ranges:
        mask[off:off + n] = True
    return mask


@FAST
@given(field_lists(min_size=1, max_size=4), st.integers(1, 3), st.integers(0, 1))
def test_sizes_offsets_and_views_match_the_oracle(fields, entries, gap) -> None:
    layer_bytes, entry_bytes, where = oracle(fields)
    strictest = max([256] + [f.align for f in fields])
    arena = LayerInterleavedArena(fields, entries, "cpu", slot_stride=entry_bytes + gap * strictest)
    assert (arena.layer_bytes, arena.entry_bytes) == (layer_bytes, entry_bytes)
    assert arena.layers == max(f.layers for f in fields)
    for f in fields:
        if f.layers:
            assert arena.field_offset(f.name) == where[(f.name, 0)][0]
        view = arena.view(f.name)
        assert tuple(view.shape) == (f.layers, entries, *f.shape)
        values = pattern(tuple(view.shape), f.dtype, seed=len(f.name))
        view.copy_(values)  # write-through: the bytes must land where the oracle says
    for f in fields:
        values = arena.view(f.name)
        for layer in range(f.layers):
            start, n = where[(f.name, layer)]
            for i in range(entries):
                at = i * arena.slot_stride + start
                got = arena.buf[at:at + n]
                want = pattern((f.layers, entries, *f.shape), f.dtype, seed=len(f.name))
                assert torch.equal(got, field_bytes(f, want, layer, i)), (f.name, layer, i)
                assert torch.equal(got, field_bytes(f, values, layer, i))


@FAST
@given(field_lists(min_size=1, max_size=4))
def test_layer_ranges_are_contiguous_prefixes_of_exactly_those_layers(fields) -> None:
    layer_bytes, entry_bytes, where = oracle(fields)
    arena = LayerInterleavedArena(fields, 2, "cpu")
    keys = list(where)
    own = owners(fields, entry_bytes, where)
    for a in range(arena.layers):
        for b in range(a + 1, arena.layers + 1):
            (off, n), = arena.layer_ranges(a, b)
            assert (off, n) == (a * layer_bytes, (b - a) * layer_bytes)
            inside = covered([(off, n)], entry_bytes)
            for k, (_, layer) in enumerate(keys):
                assert inside[own == k].all() == (a <= layer < b) or not (own == k).any()
                assert not inside[own == k].any() or a <= layer < b


@FAST
@given(field_lists(min_size=1, max_size=4))
def test_checkpoint_ranges_carry_every_carried_byte_and_no_left_out_one(fields) -> None:
    _, entry_bytes, where = oracle(fields)
    arena = LayerInterleavedArena(fields, 2, "cpu")
    ranges = arena.checkpoint_ranges
    if arena.layers:
        assert ranges == arena.layer_ranges(0, arena.layers, checkpoint=True)
    mask = covered(ranges, entry_bytes)
    by_name = {f.name: f for f in fields}
    for (name, _layer), (start, n) in where.items():
        carried = by_name[name].in_checkpoint
        assert mask[start:start + n].all() if carried else not mask[start:start + n].any()
    ends = [o + n for o, n in ranges]
    assert all(e < o for e, (o, _) in zip(ends, ranges[1:], strict=False)), "ranges overlap or touch"
    payload = sum(n for n in (v[1] for v in where.values()))
    left_out = [f for f in fields if not f.in_checkpoint and f.per_layer_bytes]
    carried = [f for f in fields if f.in_checkpoint and f.per_layer_bytes]
    if payload and not left_out:
        assert ranges == [(0, entry_bytes)]
    if left_out and carried and all(f.layers == arena.layers for f in fields):
        # the stated trade-off: a left-out field sits inside every layer
        assert len(ranges) >= arena.layers


def _kv() -> list[EntryField]:
    return [EntryField("k", 4, (2, 8), torch.float16), EntryField("v", 4, (2, 8), torch.float16),
            EntryField("scale", 2, (2,), torch.float32, in_checkpoint=False)]


def test_mixed_layer_counts_interleave_by_layer_index_with_the_stated_padding() -> None:
    arena = LayerInterleavedArena(_kv(), 2, "cpu")
    assert (arena.layer_bytes, arena.layers, arena.entry_bytes) == (768, 4, 3072)
    assert [arena.field_offset(n) for n in ("k", "v", "scale")] == [0, 256, 512]
    view = arena.view("scale")
    assert view.stride()[0] * 4 == arena.layer_bytes  # layers one layer of every field apart
    # layers 2 and 3 hold no scale: those slots are zeroed padding, never a view's
    arena.view("scale").fill_(7.0)
    assert not arena.buf[2 * 768 + 512 : 2 * 768 + 768].any()


def test_whole_entries_coalesce_and_layer_groups_are_one_range_per_entry() -> None:
    src = LayerInterleavedArena(_kv(), 8, "cpu")
    E, G = src.entry_bytes, src.layer_bytes
    whole, = plan_segments(src, [2, 3, 4], [5, 6, 7], dst_entries=8)
    assert whole.tolist() == [[2 * E, 5 * E, 3 * E]]
    groups = [plan_segments(src, [2, 3, 4], [5, 6, 7], layers=(a, a + 2))[0] for a in (0, 2)]
    assert [t.tolist() for t in groups] == [
        [[i * E + a * G, j * E + a * G, 2 * G] for i, j in ((2, 5), (3, 6), (4, 7))] for a in (0, 2)]
    # streamed groups move exactly the bytes the whole entries move
    assert np.array_equal(expand(np.concatenate(groups)), expand(whole))


@FAST
@given(field_lists(min_size=1, max_size=3), st.data())
def test_any_layer_split_moves_the_same_bytes_as_whole_entries(fields, data) -> None:
    arena = LayerInterleavedArena(fields, 6, "cpu")
    if not arena.layers:
        return
    src = data.draw(st.lists(st.integers(0, 5), unique=True, min_size=1, max_size=6))
    dst = data.draw(st.permutations(range(6)))[: len(src)]
    inner = data.draw(st.sets(st.integers(1, arena.layers - 1), max_size=3)) if arena.layers > 1 else set()
    cuts = sorted(inner | {0, arena.layers})
    checkpoint = data.draw(st.booleans())
    whole, = plan_segments(arena, src, dst, checkpoint=checkpoint)
    parts = [plan_segments(arena, src, dst, checkpoint=checkpoint, layers=(a, b))[0]
             for a, b in zip(cuts, cuts[1:], strict=False)]
    assert np.array_equal(expand(np.concatenate(parts)), expand(whole))
    if not checkpoint:
        assert sum(len(p) for p in parts) <= len(src) * (len(cuts) - 1)


def test_a_layer_group_lands_only_its_layers() -> None:
    src, dst = LayerInterleavedArena(_kv(), 4, "cpu"), LayerInterleavedArena(_kv(), 4, "cpu")
    for name in ("k", "v", "scale"):
        v = src.view(name)
        v.copy_(pattern(tuple(v.shape), v.dtype, seed=3))
    table, = plan_segments(src, [1, 2], [3, 0], layers=(0, 2))
    s, d = arena_buffers(src)[0].numpy(), arena_buffers(dst)[0].numpy()
    for so, do, n in table.tolist():
        d[do:do + n] = s[so:so + n]
    for name in ("k", "v", "scale"):
        a, b = src.view(name), dst.view(name)
        assert torch.equal(b[:2, 3], a[:2, 1]) and torch.equal(b[:2, 0], a[:2, 2])
        assert not b[2:].any(), f"{name}: a layer past the group arrived"


def test_the_ordering_is_in_the_description_so_a_mismatch_is_refused() -> None:
    plain, interleaved = EntryMajorArena(_kv(), 3, "meta"), LayerInterleavedArena(_kv(), 3, "meta")
    assert fingerprint(describe(plain)) != fingerprint(describe(interleaved))
    assert describe_diff(describe(plain), describe(interleaved)) == (
        "kind differs: entry_major vs layer_interleaved")
    assert describe(interleaved)["layer_bytes"] == 768
    assert describe_diff(describe(interleaved), describe(LayerInterleavedArena(_kv(), 9, "meta"))) is None


def test_entry_major_layer_ranges_are_one_range_per_field() -> None:
    arena = EntryMajorArena(_kv(), 4, "cpu")
    ranges = arena.entry_ranges(layers=(1, 3))
    k, v, s = (arena.field_offset(n) for n in ("k", "v", "scale"))
    assert ranges == [(k + 32, 64), (v + 32, 64), (s + 8, 8)]
    assert arena.entry_ranges(checkpoint=True, layers=(1, 3)) == [(k + 32, 64), (v + 32, 64)]
    table, = plan_segments(arena, [0, 1], [2, 3], layers=(1, 3))
    assert len(table) == 2 * 3


@pytest.mark.parametrize("layers", [(2, 2), (0, 5), (-1, 2), (0.0, 1), "ab", None.__class__])
def test_a_layer_range_outside_the_fields_is_refused(layers) -> None:
    arena = LayerInterleavedArena(_kv(), 4, "cpu")
    with pytest.raises(LayoutError, match=r"layers must be a pair \(a, b\) of ints with 0 <= a < b <= 4"):
        plan_segments(arena, [0], [1], layers=layers)


def test_page_major_refuses_a_layer_range_it_cannot_mean() -> None:
    pool = PageMajorMHAArena(2, 1, 4, 4, torch.float16, 2, 3, "cpu")
    with pytest.raises(LayoutError, match="declares each layer as a field of its own"):
        plan_segments(pool, [0], [1], layers=(0, 1))


def test_an_arena_needs_a_field() -> None:
    with pytest.raises(LayoutError, match="needs at least one field"):
        LayerInterleavedArena([], 2, "cpu")


def test_a_split_arena_checks_layers_against_all_planes_and_a_shallow_plane_ships_what_it_has() -> None:
    from pdxfer.layout import SplitEntryMajorArena
    kv, ring = _kv()[:2], [EntryField("ring", 1, (16,), torch.float32)]
    split = SplitEntryMajorArena([EntryMajorArena(kv, 4, "cpu"), EntryMajorArena(ring, 4, "cpu")])
    deep, shallow = plan_segments(split, [1], [2], layers=(2, 4))
    assert len(deep) == 2 and len(shallow) == 0
    deep, shallow = plan_segments(split, [1], [2], layers=(0, 1))
    assert shallow.tolist() == [[split.arenas[1].slot_stride, 2 * split.arenas[1].slot_stride, 64]]


def test_a_per_layer_pool_ships_only_the_tensors_of_the_layer_range() -> None:
    from pdxfer.layout import PerLayerArena
    pool = PerLayerArena({"k": [torch.zeros(8, 4, dtype=torch.float16) for _ in range(4)],
                          "v": [torch.zeros(8, 4, dtype=torch.float16) for _ in range(4)]})
    tables = plan_segments(pool, [1, 2], [5, 6], layers=(1, 3))
    assert [len(t) for t in tables] == [0, 1, 1, 0, 0, 1, 1, 0]  # k0..k3, v0..v3; runs merge
