"""Segment tables cover exactly the named entries' bytes, merged, and nothing else.

The oracle is a brute-force listing, one row per entry (per range, per field
and layer for layer-major), expanded to byte pairs; the planned table must move
exactly those bytes, be maximally merged, and — applied as plain copies —
deliver every named entry's fields while leaving every other byte untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST, expand, field_lists
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    LayoutError,
    PageMajorMHAArena,
    SplitEntryMajorArena,
    arena_buffers,
    check_indices,
    coalesce,
    entry_bytes_for,
    plan_field_planes,
    plan_segments,
)

CANARY = 0xA5


def split_arena(fields: list[EntryField], entries: int, live: int, widths: list[int]):
    groups, rows = plan_field_planes(fields, widths)
    planes = []
    for group, width in zip(groups, widths, strict=True):
        # A plane's slot must also keep its strictest field's boundary.
        align = max([256] + [f.align for f in group])
        stride = -(-max(rows * width, 1) // align) * align
        planes.append(EntryMajorArena(group, entries, "cpu", slot_stride=stride, live_entries=live))
    return SplitEntryMajorArena(planes)


@st.composite
def arena_pairs(draw: st.DrawFn):
    """(source arena, destination arena of the same format) of a random kind."""
    kind = draw(st.sampled_from(["entry", "layer", "split", "page"]))
    entries, dst_entries = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    if kind == "page":
        geo = dict(layer_num=draw(st.integers(1, 2)), head_num=draw(st.integers(1, 2)),
                   head_dim=draw(st.integers(1, 4)), v_head_dim=draw(st.integers(1, 4)),
                   store_dtype=torch.float16, page_size=draw(st.integers(1, 3)), device="cpu")
        return PageMajorMHAArena(num_pages=entries, **geo), PageMajorMHAArena(num_pages=dst_entries, **geo)
    fields = draw(field_lists(min_size=1, max_size=4))
    if kind == "layer":
        return LayerMajorArena(fields, entries, "cpu"), LayerMajorArena(fields, dst_entries, "cpu")
    live = draw(st.integers(1, entries))
    if kind == "split":
        widths = draw(st.lists(st.sampled_from([256, 512, 1024]), min_size=1, max_size=2))
        return split_arena(fields, entries, live, widths), split_arena(fields, dst_entries, dst_entries, widths)
    strictest = max([256] + [f.align for f in fields])
    stride = entry_bytes_for(fields) + strictest * draw(st.integers(0, 1))
    return (EntryMajorArena(fields, entries, "cpu", slot_stride=stride, live_entries=live),
            EntryMajorArena(fields, dst_entries, "cpu", slot_stride=stride))


def brute_rows(arena, src, dst, checkpoint: bool, dst_entries: int) -> list[np.ndarray]:
    """One row per entry and range (per field, layer and entry for layer-major)."""
    def strided(a):
        ranges = a.checkpoint_ranges if checkpoint else [(0, a.entry_bytes)]
        return [(s * a.slot_stride + o, d * a.slot_stride + o, n)
                for s, d in zip(src, dst, strict=True) for o, n in ranges if n]
    if isinstance(arena, SplitEntryMajorArena):
        tables = [strided(p) for p in arena.arenas]
    elif isinstance(arena, LayerMajorArena):
        rows = []
        for f in arena.fields:
            if checkpoint and not f.in_checkpoint:
                continue
            off, pl = arena.field_offset(f.name), f.per_layer_bytes
            for layer in range(f.layers):
                for s, d in zip(src, dst, strict=True):
                    if pl:
                        rows.append((off * arena.entries + (layer * arena.entries + s) * pl,
                                     off * dst_entries + (layer * dst_entries + d) * pl, pl))
        tables = [rows]
    else:
        tables = [strided(arena)]
    return [np.array(t, dtype=np.int64).reshape(-1, 3) for t in tables]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


@FAST
@given(arena_pairs(), st.data())
def test_planned_segments_move_exactly_the_named_entries(pair, data: st.DataObject) -> None:
    src_arena, dst_arena = pair
    first_live = src_arena.entries - src_arena.live_entries
    src = data.draw(st.lists(st.integers(first_live, src_arena.entries - 1), unique=True,
                             max_size=dst_arena.entries))
    dst = data.draw(st.permutations(range(dst_arena.entries)))[: len(src)]
    checkpoint = data.draw(st.booleans())
    tables = plan_segments(src_arena, np.array(src, dtype=np.int32), dst, checkpoint=checkpoint,
                           dst_entries=dst_arena.entries)
    src_bufs, dst_bufs = arena_buffers(src_arena), arena_buffers(dst_arena)
    oracle = brute_rows(src_arena, src, dst, checkpoint, dst_arena.entries)
    assert len(tables) == len(src_bufs) == len(oracle)
    gen = torch.Generator().manual_seed(len(src))
    for table, want, sbuf, dbuf in zip(tables, oracle, src_bufs, dst_bufs, strict=True):
        assert table.dtype == np.int64 and table.flags.c_contiguous and table.shape[1:] == (3,)
        assert (table[:, 2] > 0).all()
        assert np.array_equal(expand(table), expand(want))
        assert np.array_equal(coalesce(table), table)  # sorted and maximally merged
        # Applied as plain copies: named bytes arrive, every other byte keeps its canary.
        sbuf.copy_(torch.randint(0, 256, sbuf.shape, generator=gen, dtype=torch.uint8))
        dbuf.fill_(CANARY)
        for s, d, n in table.tolist():
            dbuf[d : d + n] = sbuf[s : s + n]
        moved = expand(table)
        untouched = np.ones(dbuf.numel(), dtype=bool)
        untouched[moved[:, 1]] = False
        assert (dbuf.numpy()[untouched] == CANARY).all()
    # Field by field: every named entry's carried fields arrived bit for bit.
    for f in src_arena.fields:
        if checkpoint and not f.in_checkpoint:
            continue
        got = _bytes(dst_arena.view(f.name)[:, dst])
        sent = _bytes(src_arena.view(f.name)[:, src])
        assert torch.equal(got, sent), f.name


def test_consecutive_entries_merge_and_gaps_do_not() -> None:
    fields = [EntryField("kv", 1, (64,), torch.float32)]  # 256 B: stride == entry
    arena = EntryMajorArena(fields, 8, "cpu")
    (t,) = plan_segments(arena, [2, 3, 4, 6], [5, 6, 7, 0])
    assert t.tolist() == [[512, 1280, 768], [1536, 0, 256]]
    wide = EntryMajorArena(fields, 8, "cpu", slot_stride=512)
    (t,) = plan_segments(wide, [2, 3], [0, 1])
    assert t.tolist() == [[1024, 0, 256], [1536, 512, 256]]  # padding between slots is not ours
    (t,) = plan_segments(arena, [4, 2, 3], [7, 5, 6])  # reordered by source, then merged
    assert t.tolist() == [[512, 1280, 768]]


def test_layer_major_costs_a_segment_per_field_and_layer() -> None:
    fields = [EntryField("k", 3, (64,), torch.float16), EntryField("v", 3, (64,), torch.float16)]
    arena = LayerMajorArena(fields, 10, "cpu")
    (t,) = plan_segments(arena, [1, 2, 7], [0, 1, 2], dst_entries=4)
    assert t.shape[0] == 2 * 3 * 2  # fields x layers x runs
    (t,) = plan_segments(arena, list(range(10)), list(range(10)))
    # Everything, in order: one segment per field region (k's padding is not shipped).
    k_region = 3 * 10 * 128
    assert arena.region_offset("v") == 512 * 10
    assert t.tolist() == [[0, 0, k_region], [5120, 5120, k_region]]


def test_checkpoint_segments_skip_left_out_fields() -> None:
    fields = [
        EntryField("kv", 1, (64,), torch.float32),
        EntryField("ring", 1, (64,), torch.float32, in_checkpoint=False),
        EntryField("score", 1, (64,), torch.float32, fill=float("-inf")),
    ]
    arena = EntryMajorArena(fields, 4, "cpu")
    (t,) = plan_segments(arena, [0, 1], [2, 3], checkpoint=True)
    assert t.tolist() == [[0, 1536, 256], [512, 2048, 512], [1280, 2816, 256]]


def test_empty_requests_plan_empty_tables() -> None:
    arena = EntryMajorArena([EntryField("kv", 1, (64,), torch.float32)], 4, "cpu")
    (t,) = plan_segments(arena, [], [])
    assert t.shape == (0, 3) and t.dtype == np.int64
    (t,) = plan_segments(EntryMajorArena([], 4, "cpu"), [1], [1])
    assert t.shape == (0, 3)


def test_repeated_sources_broadcast_to_distinct_destinations() -> None:
    arena = EntryMajorArena([EntryField("kv", 1, (64,), torch.float32)], 4, "cpu")
    (t,) = plan_segments(arena, [1, 1, 0], [3, 0, 1])
    assert sorted(t.tolist()) == [[0, 256, 256], [256, 0, 256], [256, 768, 256]]


def test_dense_and_sparse_index_spaces_plan_alike() -> None:
    fields = [EntryField("kv", 1, (64,), torch.float32)]
    big = EntryMajorArena(fields, 100_000, "meta")  # sparse request: sorted by argsort
    rng = np.random.default_rng(1)
    src = rng.choice(100_000, 50, replace=False)
    dst = rng.permutation(50)
    (t,) = plan_segments(big, src, dst, dst_entries=50)
    order = np.argsort(src)
    assert t.tolist() == [[int(s) * 256, int(d) * 256, 256] for s, d in zip(src[order], dst[order],
                                                                            strict=True)]


ARENA = EntryMajorArena([EntryField("kv", 1, (64,), torch.float32)], 4, "cpu", live_entries=3)


@pytest.mark.parametrize(
    ("src", "dst", "kw", "match"),
    [
        ([1, 2, 3], [0, 1], {}, "3 source indices but 2 destination indices"),
        ([[1, 2]], [[0, 1]], {}, r"source indices must be a 1-D array, got shape \[1, 2\]"),
        ([1.0, 2.0], [0, 1], {}, "source indices must be integers, got dtype float64"),
        ([True], [0], {}, "must be integers, got dtype bool"),
        ([1, -2], [0, 1], {}, "source index -2 at position 1 is negative"),
        ([1, 4], [0, 1], {}, r"source index 4 at position 1 is >= the 4 entries; valid indices are 0\.\.3"),
        ([0, 1], [0, 1], {}, r"source index 0 at position 0 is outside the live entries 1\.\.3"),
        ([1, 2], [0, 9], {"dst_entries": 9}, "destination index 9 at position 1 is >= the 9 entries"),
        ([1, 2, 3], [0, 2, 0], {}, "destination index 0 appears 2 times"),
        ([1, 2, 3], [5, 2, 5], {"dst_entries": 40}, "destination index 5 appears 2 times"),
        ([1], [0], {"dst_entries": -1}, "dst_entries must be an integer >= 0, got -1"),
    ],
)
def test_plan_refusals(src, dst, kw, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_segments(ARENA, src, dst, **kw)


def test_check_indices() -> None:
    got = check_indices(ARENA, np.array([3, 1], dtype=np.uint8), what="decode entry")
    assert got.dtype == np.int64 and got.tolist() == [3, 1]
    with pytest.raises(LayoutError, match=r"decode entry 0 at position 1 is outside the live entries 1\.\.3"):
        check_indices(ARENA, [2, 0], what="decode entry")
    with pytest.raises(LayoutError, match="index 3 appears 2 times"):
        check_indices(ARENA, [3, 3], unique=True)
    assert check_indices(ARENA, torch.tensor([1, 2])).tolist() == [1, 2]
    with pytest.raises(LayoutError, match="str is not an arena layout knows"):
        check_indices("arena", [1])
    with pytest.raises(LayoutError, match="not an arena layout knows"):
        plan_segments(object(), [1], [1])


@FAST
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 6)), max_size=12),
       st.randoms())
def test_coalesce_keeps_the_bytes_and_merges(rows, rnd) -> None:
    # Destinations distinct per byte: build them from disjoint slots of 8.
    table = np.array([(s, 8 * i, n) for i, (s, _, n) in enumerate(rows)], dtype=np.int64).reshape(-1, 3)
    order = list(range(len(table)))
    rnd.shuffle(order)
    shuffled = table[order]
    out = coalesce(shuffled)
    assert np.array_equal(expand(out), expand(table[table[:, 2] > 0]))
    assert (out[:, 2] > 0).all() and np.array_equal(coalesce(out), out)
    joined = (out[1:, 0] == out[:-1, 0] + out[:-1, 2]) & (out[1:, 1] == out[:-1, 1] + out[:-1, 2])
    assert not joined.any()


def test_coalesce_refusals() -> None:
    with pytest.raises(LayoutError, match=r"shape \[n, 3\].*got \[2, 2\]"):
        coalesce(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(LayoutError, match="holds integers, got dtype float64"):
        coalesce(np.zeros((1, 3)))
    with pytest.raises(LayoutError, match="segment row 1 has negative nbytes -4"):
        coalesce(np.array([[0, 0, 4], [4, 4, -4]]))
