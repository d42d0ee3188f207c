"""PerLayerArena: an engine's per-layer tensors adopted as one pool, planned in one call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayoutError,
    PerLayerArena,
    arena_buffers,
    describe,
    fingerprint,
    plan_segments,
)

L, P, H, D = 4, 16, 8, 64


def _engine_tensors(pages: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """What SGLang's MHATokenToKVPool allocates: one [rows, H, D] tensor per layer, K and V."""
    gen = torch.Generator().manual_seed(seed)
    return {name: [torch.randn(pages * P, H, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
            for name in ("k", "v")}


def test_adopts_the_tensors_without_copying_or_writing() -> None:
    tensors = _engine_tensors(8, 0)
    before = [t.clone() for ts in tensors.values() for t in ts]
    arena = PerLayerArena(tensors, entry_rows=P)
    assert (arena.entries, len(arena.fields)) == (8, 2)
    assert arena.fields[0] == EntryField("k", L, (P, H, D), torch.bfloat16)
    bufs = arena_buffers(arena)
    assert len(bufs) == 2 * L
    for buf, t, old in zip(bufs, [t for ts in tensors.values() for t in ts], before, strict=True):
        assert buf.data_ptr() == t.data_ptr() and buf.numel() == t.numel() * 2
        assert torch.equal(t, old)
    assert arena.view("v", 3).data_ptr() == tensors["v"][3].data_ptr()
    assert arena.view("v", 3).shape == (8, P, H, D)


def test_one_call_plans_a_table_per_tensor_equal_to_a_per_layer_reference() -> None:
    arena = PerLayerArena(_engine_tensors(64, 0), entry_rows=P)
    rng = np.random.default_rng(0)
    src = rng.choice(64, 20, replace=False)
    dst = rng.choice(64, 20, replace=False)
    tables = plan_segments(arena, src, dst)
    assert len(tables) == 2 * L
    page = P * H * D * 2
    order = np.argsort(src)
    want = np.stack([src[order] * page, dst[order] * page, np.full(20, page)], 1)
    # Rows merge only where pages run on both sides; expand them back to pages to compare.
    for table in tables:
        rows = [(s + k * page, d + k * page, page) for s, d, n in table.tolist() for k in range(n // page)]
        assert np.array_equal(np.array(rows), want)
    assert len({id(t) for t in tables}) == len(tables)  # distinct arrays: callers shift in place
    tables[0][:, 0] += 7
    assert tables[1][0, 0] != tables[0][0, 0]


def test_description_is_one_per_pool_and_stable() -> None:
    a = PerLayerArena(_engine_tensors(8, 0), entry_rows=P)
    b = PerLayerArena(_engine_tensors(16, 1), entry_rows=P)
    assert describe(a)["kind"] == "per_layer"
    assert fingerprint(describe(a)) == fingerprint(describe(b))  # entries are not the format
    c = PerLayerArena({"k": _engine_tensors(8, 0)["k"]}, entry_rows=P)
    assert fingerprint(describe(a)) != fingerprint(describe(c))


def test_entry_major_cuts_segments_by_two_l() -> None:
    fields = [EntryField("k", L, (P, H, D), torch.bfloat16), EntryField("v", L, (P, H, D), torch.bfloat16)]
    per_layer = PerLayerArena(_engine_tensors(64, 0), entry_rows=P)
    entry = EntryMajorArena(fields, 64, "meta")
    src, dst = np.array([3, 4, 5, 9, 20]), np.array([0, 1, 2, 3, 4])
    assert sum(len(t) for t in plan_segments(per_layer, src, dst)) == 2 * L * 3  # 3 runs
    assert sum(len(t) for t in plan_segments(entry, src, dst)) == 3


@pytest.mark.parametrize(("tensors", "match"), [
    ({}, "non-empty mapping"),
    ({"k": []}, "non-empty list of per-layer tensors"),
    ({"k": [torch.zeros(32, 2), torch.zeros(32, 3)]}, r"field 'k' layer 1: \[32, 3\] .* layer 0 is \[32, 2\]"),
    ({"k": [torch.zeros(3, 32).t()]}, "layer 0 is not contiguous"),
    ({"k": [torch.zeros(32, 2)], "v": [torch.zeros(48, 2)]}, "field 'v' holds 3 entries .* 'k' holds 2"),
])
def test_refusals_name_the_tensor(tensors, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        PerLayerArena(tensors, entry_rows=16)


def test_indices_are_checked_before_any_table() -> None:
    arena = PerLayerArena(_engine_tensors(8, 0), entry_rows=P)
    with pytest.raises(LayoutError, match="destination index 8 at position 1 is >= the 8 entries"):
        plan_segments(arena, [0, 1], [0, 8])


def _kv(rows: int = 4 * P) -> torch.Tensor:
    return torch.zeros(rows, H, D, dtype=torch.bfloat16)


def _aliased_same_tensor() -> dict:
    t = _kv()
    return {"k": [_kv(), t], "v": [_kv(), t]}


def _aliased_views() -> dict:
    whole = torch.zeros(5 * P, H, D, dtype=torch.bfloat16)
    return {"k": [whole[:4 * P], whole[P:]]}  # rows P..4P-1 in both layers


def _aliased_k_v() -> dict:
    kv = torch.zeros(2, 4 * P, H, D, dtype=torch.bfloat16)
    return {"k": [kv[0], kv[1]], "v": [kv[1], _kv()]}  # k layer 1 is v layer 0


@pytest.mark.parametrize(("build", "match"), [
    (_aliased_same_tensor, r"field 'v' layer 1 shares memory with field 'k' layer 1"),
    (_aliased_views, r"field 'k' layer 1 shares memory with field 'k' layer 0"),
    (_aliased_k_v, r"field 'v' layer 0 shares memory with field 'k' layer 1"),
], ids=["same-tensor-twice", "overlapping-views", "k-and-v-share-storage"])
def test_tensors_sharing_memory_are_refused_naming_both_layers(build, match: str) -> None:
    """Two layers over one byte would each receive the other's pages: refused, by name."""
    with pytest.raises(LayoutError, match=match + r".*give every layer its own memory"):
        PerLayerArena(build(), entry_rows=P)


def test_views_of_one_allocation_that_do_not_overlap_are_accepted() -> None:
    whole = torch.zeros(4, 2 * P, H, D, dtype=torch.bfloat16)
    arena = PerLayerArena({"k": [whole[0], whole[1]], "v": [whole[2], whole[3]]}, entry_rows=P)
    assert arena.entries == 2


def test_rows_past_the_last_whole_entry_are_refused() -> None:
    with pytest.raises(LayoutError, match=(
            r"field 'k' holds 40 rows, not a multiple of entry_rows=16 \(8 rows left over\); "
            r"pass whole entries, e.g. t\[:32\]")):
        PerLayerArena({"k": [torch.zeros(40, 2)]}, entry_rows=16)
