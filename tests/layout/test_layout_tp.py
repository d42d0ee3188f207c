"""Heterogeneous TP: shard-major arenas and rank-pair plans against plain-Python oracles.

The oracles here loop per entry, per head group and per byte on purpose; the
code under test is array arithmetic. Byte-level: every decode rank's entry is
assembled by applying its contributors' tables byte by byte, and must equal
the monolithic entry restricted to its heads; a TP=1 decode must equal the
TP=1 entry byte for byte, padding included; bytes outside the tables never
change (canaries).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST
from pdxfer.layout import (
    EntryField,
    LayoutError,
    ShardMajorArena,
    contributing_ranks,
    describe,
    describe_diff,
    fingerprint,
    is_split_pair,
    pair_pieces,
    plan_rank_pair,
    rank_pair,
    replica_source,
)

DTYPES = [torch.float32, torch.float16, torch.int32, torch.uint8]
CANARY = 0xA5


@st.composite
def model(draw: st.DrawFn) -> tuple[list[EntryField], int]:
    """A field list with split fields sharing `heads`, optionally replicated ones."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    fields = []
    for i in range(draw(st.integers(0, 3))):
        # A field may carry a multiple of the group count (scales, or k with
        # fewer heads than v in a GQA variant), so units = gcd stays general.
        mult = draw(st.sampled_from([1, 1, 2]))
        shape = [draw(st.integers(1, 3)), heads * mult, draw(st.integers(1, 5))]
        axis = 1
        if draw(st.booleans()):
            shape = [heads * mult, shape[0], shape[2]]
            axis = 0
        fields.append(EntryField(f"s{i}", draw(st.integers(1, 3)), tuple(shape),
                                 draw(st.sampled_from(DTYPES)), tp_axis=axis,
                                 align=draw(st.sampled_from([0, 0, 512])),
                                 in_checkpoint=draw(st.booleans())))
    for i in range(draw(st.integers(0 if fields else 1, 2))):
        fields.append(EntryField(f"r{i}", draw(st.integers(1, 2)), (draw(st.integers(1, 7)),),
                                 draw(st.sampled_from(DTYPES)),
                                 in_checkpoint=draw(st.booleans())))
    return fields, heads


def _splits(fields: list[EntryField], heads: int) -> tuple[bool, list[int]]:
    """Whether any field is split, and the TP sizes the model admits."""
    split = any(f.tp_axis is not None for f in fields)
    return split, [t for t in (1, 2, 4, 8) if heads % t == 0] if split else [1, 2, 4]


def _global_values(fields: list[EntryField], entries: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f.name: torch.randint(1, 120, (f.layers, entries) + f.shape, generator=gen).to(f.dtype)
            for f in fields}


def _slice(f: EntryField, value: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    if f.tp_axis is None:
        return value
    return value.narrow(2 + f.tp_axis, lo, hi - lo)


def _rank_heads(f: EntryField, tp: int, rank: int) -> tuple[int, int]:
    n = f.shape[f.tp_axis] // tp
    return rank * n, (rank + 1) * n


def _fill(arena: ShardMajorArena, values: dict[str, torch.Tensor]) -> None:
    """A rank's arena loaded from the global tensors, head group by head group."""
    g = arena.geometry
    for f in arena.declared:
        if f.tp_axis is None:
            arena.view(f.name).copy_(values[f.name])
            continue
        lo, hi = _rank_heads(f, g.tp, g.rank)
        per = (hi - lo) // g.local_units
        for u in range(g.local_units):
            arena.group_view(f.name, u).copy_(_slice(f, values[f.name], lo + u * per, lo + (u + 1) * per))


def _apply(table: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The oracle transport: one Python copy per row, byte by byte."""
    s, d = src.numpy(), dst.numpy()
    for so, do, n in table.tolist():
        for k in range(n):
            d[do + k] = s[so + k]


def _oracle_table(src: ShardMajorArena, dst: ShardMajorArena, pairs: list[tuple[int, int]]) -> list[list[int]]:
    """Rows per entry pair from the head fractions, merged in plain Python."""
    gs, gd = src.geometry, dst.geometry
    rows = []
    for s, d in sorted(pairs):
        for u in range(gs.units):
            if gs.first_unit <= u < gs.end_unit and gd.first_unit <= u < gd.end_unit:
                rows.append([s * src.slot_stride + (u - gs.first_unit) * gs.unit_bytes,
                             d * dst.slot_stride + (u - gd.first_unit) * gd.unit_bytes,
                             gs.unit_bytes])
        if gs.rank == replica_source(gs.tp, gd.tp, gd.rank) and gs.rep_span:
            rows.append([s * src.slot_stride + gs.rep_base, d * dst.slot_stride + gd.rep_base,
                         gs.rep_span])
    merged: list[list[int]] = []
    for r in rows:
        if merged and merged[-1][0] + merged[-1][2] == r[0] and merged[-1][1] + merged[-1][2] == r[1]:
            merged[-1][2] += r[2]
        else:
            merged.append(list(r))
    return merged


@FAST
@given(model(), st.data())
def test_rank_pairs_reassemble_the_monolithic_entry(spec, data) -> None:
    fields, heads = spec
    split, sizes = _splits(fields, heads)
    P, D = data.draw(st.sampled_from(sizes)), data.draw(st.sampled_from(sizes))
    n = data.draw(st.integers(1, 5))
    src_entries, dst_entries = n + 2, n + 3
    src_idx = data.draw(st.permutations(range(src_entries)))[:n]
    dst_idx = data.draw(st.permutations(range(dst_entries)))[:n]
    values = _global_values(fields, src_entries, data.draw(st.integers(0, 99)))
    prefill = [ShardMajorArena(fields, src_entries, "cpu", tp=P, rank=p) for p in range(P)]
    for arena in prefill:
        _fill(arena, values)
    for q in range(D):
        dst = ShardMajorArena(fields, dst_entries, "cpu", tp=D, rank=q)
        dst.buf.fill_(CANARY)
        written = np.zeros(dst.buf.numel(), dtype=bool)
        for p in range(P):
            table, = plan_rank_pair(prefill[p], dst, src_idx, dst_idx)
            assert table.tolist() == _oracle_table(prefill[p], dst, list(zip(src_idx, dst_idx, strict=True)))
            if p not in contributing_ranks(P, D, q, split=split):
                assert table.shape[0] == 0, f"prefill rank {p} is not a contributor of {q}"
                continue
            _apply(table, prefill[p].buf, dst.buf)
            for _so, do, nb in table.tolist():
                assert not written[do:do + nb].any(), "two prefill ranks wrote one byte"
                written[do:do + nb] = True
        ordered = torch.as_tensor(dst_idx)
        for f in fields:
            lo, hi = _rank_heads(f, D, q) if f.tp_axis is not None else (0, 0)
            want = _slice(f, values[f.name], lo, hi)[:, torch.as_tensor(src_idx)]
            for g in range(dst.geometry.local_units if f.tp_axis is not None else 0):
                per = (hi - lo) // dst.geometry.local_units
                got = dst.group_view(f.name, g)[:, ordered]
                assert torch.equal(got, want.narrow(2 + f.tp_axis, g * per, per))
            if f.tp_axis is None:
                assert torch.equal(dst.view(f.name)[:, ordered], want)
        untouched = dst.buf.numpy()[~written]
        assert (untouched == CANARY).all(), "a byte outside every table changed"
        if D == 1:
            mono = ShardMajorArena(fields, src_entries, "cpu", tp=1, rank=0)
            for p in range(P):
                table, = plan_rank_pair(prefill[p], mono, src_idx, src_idx)
                _apply(table, prefill[p].buf, mono.buf)
            for s, d in zip(src_idx, dst_idx, strict=True):
                written_here = written[d * dst.slot_stride:(d + 1) * dst.slot_stride]
                got = dst.entry(d).numpy()[written_here[:dst.entry_bytes]]
                assert (got == mono.entry(s).numpy()[written_here[:dst.entry_bytes]]).all()


@FAST
@given(model(), st.data())
def test_one_segment_per_entry_per_pair_when_the_prefill_is_wider(spec, data) -> None:
    """P >= D: the overlap and the replicated block abut, so one row per entry."""
    fields, heads = spec
    split, sizes = _splits(fields, heads)
    P = data.draw(st.sampled_from(sizes))
    D = data.draw(st.sampled_from([t for t in sizes if t <= P]))
    n = data.draw(st.integers(1, 6))
    dst_idx = np.array(data.draw(st.permutations(range(n + 4)))[:n])
    for q in range(D):
        dst = ShardMajorArena(fields, n + 4, "meta", tp=D, rank=q)
        for p in contributing_ranks(P, D, q, split=split):
            src = ShardMajorArena(fields, n, "meta", tp=P, rank=p)
            table, = plan_rank_pair(src, dst, np.arange(n), dst_idx)
            pieces = pair_pieces(src.geometry, dst.geometry)
            expected = n
            if pieces.tolist() == [[0, 0, src.entry_bytes]] and src.entry_bytes == dst.entry_bytes:
                # A whole slot on both sides: runs consecutive on both sides merge.
                expected = 1 + int(np.count_nonzero(np.diff(dst_idx) != 1))
            assert table.shape[0] == expected, (P, D, p, q, table)


def test_runs_of_entries_merge_when_a_piece_is_a_whole_slot() -> None:
    fields = [EntryField("latent", 2, (4, 8), torch.float16)]  # MLA: nothing split
    src = ShardMajorArena(fields, 16, "meta", tp=4, rank=3)
    dst = ShardMajorArena(fields, 16, "meta", tp=2, rank=1)
    assert contributing_ranks(4, 2, 1, split=False) == [3]
    table, = plan_rank_pair(src, dst, np.arange(8), np.arange(4, 12))
    assert table.tolist() == [[0, 4 * dst.slot_stride, 8 * src.entry_bytes]]
    other = ShardMajorArena(fields, 16, "meta", tp=4, rank=2)
    assert plan_rank_pair(other, dst, np.arange(8), np.arange(4, 12))[0].shape == (0, 3)


def test_contributors_cover_each_decode_rank_once() -> None:
    for P in (1, 2, 4, 8):
        for D in (1, 2, 4, 8):
            for q in range(D):
                ranks = contributing_ranks(P, D, q)
                lo, hi = q / D, (q + 1) / D
                assert ranks == [p for p in range(P) if p / P < hi and lo < (p + 1) / P]
                assert replica_source(P, D, q) == ranks[-1]


def test_views_are_strided_per_head_and_land_in_their_group() -> None:
    k = EntryField("k", 2, (4, 8, 16), torch.float32, tp_axis=1)
    arena = ShardMajorArena([k, EntryField("v", 2, (4, 8, 16), torch.float32, tp_axis=1)],
                            3, "cpu", tp=2, rank=1)
    view = arena.view("k")
    assert view.shape == (2, 3, 4, 4, 16)
    assert view.stride()[3] * 4 == arena.geometry.unit_bytes
    assert arena.heads("k") == (4, 8)
    view[1, 2, :, 3] = 7.0
    assert (arena.group_view("k", 3)[1, 2] == 7.0).all()
    assert (arena.group_view("k", 2) == 0).all()
    gqa = ShardMajorArena([k, EntryField("s", 1, (16, 2), torch.float32, tp_axis=1)], 3, "cpu",
                          tp=1, rank=0)
    with pytest.raises(LayoutError, match=r"4 heads per head group and 2 groups.*group_view"):
        gqa.view("k")


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_by_name() -> None:
    k = EntryField("k", 2, (4, 6, 16), torch.float32, tp_axis=1)
    with pytest.raises(LayoutError, match=r"field 'k' has 6 heads on tp_axis 1, which TP size 4"):
        ShardMajorArena([k], 3, "meta", tp=4, rank=0)
    with pytest.raises(LayoutError, match=r"tp_axis 3 names no non-empty dim"):
        EntryField("k", 2, (4, 6, 16), torch.float32, tp_axis=3)


def _descs(fields_a, fields_b, a=(4, 1), b=(2, 0)):
    return (describe(ShardMajorArena(fields_a, 5, "meta", tp=a[0], rank=a[1])),
            describe(ShardMajorArena(fields_b, 9, "meta", tp=b[0], rank=b[1])))


def test_compatible_splits_pass_the_handshake_check() -> None:
    fields = [EntryField("k", 2, (4, 8, 16), torch.bfloat16, tp_axis=1),
              EntryField("lat", 2, (4, 32), torch.bfloat16)]
    a, b = _descs(fields, fields)
    assert fingerprint(a) != fingerprint(b)  # the split is part of the exact format
    assert describe_diff(a, b) is None and is_split_pair(a, b)
    back = msgpack.unpackb(msgpack.packb(a), raw=False)
    assert describe_diff(back, b) is None and fingerprint(back) == fingerprint(a)
    same = describe(ShardMajorArena(fields, 7, "meta", tp=4, rank=1))
    assert fingerprint(same) == fingerprint(a) and not is_split_pair(a, same)
    assert rank_pair(ShardMajorArena(fields, 5, "meta", tp=4, rank=1), same) is None


def test_incompatible_splits_are_refused_by_name() -> None:
    k = EntryField("k", 2, (4, 8, 16), torch.float32, tp_axis=1)
    a, b = _descs([k], [EntryField("k", 2, (4, 8, 32), torch.float32, tp_axis=1)])
    assert describe_diff(a, b) == "field 'k' differs in shape: [4, 8, 16] vs [4, 8, 32]"
    a, b = _descs([k], [EntryField("k", 2, (4, 4, 16), torch.float32, tp_axis=1)])
    assert describe_diff(a, b) == "field 'k' differs in shape: [4, 8, 16] vs [4, 4, 16]"
    a, b = _descs([k], [EntryField("k", 2, (4, 8, 16), torch.float32, tp_axis=0)])
    assert "differs in tp_axis: 1 vs 0" in describe_diff(a, b)
    a, b = _descs([k], [k])
    forged = dict(b, tp={"size": 3, "rank": 0})
    assert describe_diff(a, forged) == (
        "TP split {'rank': 0, 'size': 3} refused: field 'k' has 8 heads on tp_axis 1, which "
        "TP size 3 does not divide; use a TP size in [1, 2, 4, 8] or declare the field "
        "replicated (tp_axis=None)")
    lying = dict(b, entry_bytes=b["entry_bytes"] + 256)
    assert "entry_bytes is" in describe_diff(a, lying)
    with pytest.raises(LayoutError, match="entry_bytes is"):
        rank_pair(ShardMajorArena([k], 5, "meta", tp=4, rank=1), lying)


@FAST
@given(model(), st.data())
def test_checkpoint_plans_move_exactly_the_carried_fields(spec, data) -> None:
    fields, heads = spec
    split, sizes = _splits(fields, heads)
    P, D = data.draw(st.sampled_from(sizes)), data.draw(st.sampled_from(sizes))
    values = _global_values(fields, 3, data.draw(st.integers(0, 99)))
    q = data.draw(st.integers(0, D - 1))
    dst = ShardMajorArena(fields, 4, "cpu", tp=D, rank=q)
    dst.buf.fill_(CANARY)
    before = dst.buf.clone()
    for p in contributing_ranks(P, D, q, split=split):
        src = ShardMajorArena(fields, 3, "cpu", tp=P, rank=p)
        _fill(src, values)
        table, = plan_rank_pair(src, dst, [2, 0], [1, 3], checkpoint=True)
        _apply(table, src.buf, dst.buf)
    fresh = ShardMajorArena(fields, 4, "cpu", tp=D, rank=q)
    fresh.buf.copy_(before)  # the canaries, read through the same views
    for f in fields:
        lo, hi = _rank_heads(f, D, q) if f.tp_axis is not None else (0, 0)
        groups = range(dst.geometry.local_units) if f.tp_axis is not None else [None]
        for g in groups:
            got = dst.view(f.name) if g is None else dst.group_view(f.name, g)
            old = fresh.view(f.name) if g is None else fresh.group_view(f.name, g)
            if not f.in_checkpoint:
                assert torch.equal(got, old), f"{f.name} is not in the checkpoint but moved"
                continue
            want = _slice(f, values[f.name], lo, hi)
            if g is not None:
                per = (hi - lo) // dst.geometry.local_units
                want = want.narrow(2 + f.tp_axis, g * per, per)
            assert torch.equal(got[:, [1, 3]], want[:, [2, 0]])
            assert torch.equal(got[:, [0, 2]], old[:, [0, 2]])
