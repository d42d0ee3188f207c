"""The one field walk and the region planner: properties over random declarations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST, extents_by_hand, field_lists
from pdxfer.layout import (
    EntryField,
    LayoutError,
    carve,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    plan_field_planes,
    plan_regions,
)

sizes = st.lists(st.integers(0, 3000), max_size=6)


@FAST
@given(sizes, sizes)
def test_plan_regions_concatenates(a: list[int], b: list[int]) -> None:
    offs_a, total_a = plan_regions(a)
    offs_b, total_b = plan_regions(b)
    offs_ab, total_ab = plan_regions(a + b)
    assert offs_ab == offs_a + [o + total_a for o in offs_b]
    assert total_ab == total_a + total_b


@FAST
@given(sizes, st.data())
def test_plan_regions_aligned_disjoint_in_order(sizes: list[int], data: st.DataObject) -> None:
    aligns = data.draw(st.lists(st.sampled_from([0, 256, 512, 2048]), min_size=len(sizes),
                                max_size=len(sizes)))
    offsets, total = plan_regions(sizes, aligns)
    assert total % 256 == 0
    end = 0
    for off, size, align in zip(offsets, sizes, aligns, strict=True):
        assert off % max(256, align) == 0
        assert off >= end  # regions in order, never overlapping
        assert off - end < max(256, align)  # and no more padding than the boundary asks
        end = off + size
    assert end <= total < end + 256


@FAST
@given(sizes, st.integers(0, 300))
def test_carve_regions_are_their_planned_bytes(sizes: list[int], slack: int) -> None:
    offsets, total = plan_regions(sizes)
    buf = torch.zeros(total + slack, dtype=torch.uint8)
    regions = carve(buf, sizes)
    for region, off, size in zip(regions, offsets, sizes, strict=True):
        assert region.numel() == size
        assert region.data_ptr() == buf.data_ptr() + off or size == 0
    assert carve(None, sizes) == [None] * len(sizes)
    if total:
        with pytest.raises(LayoutError, match=rf"buffer of {total - 1} B cannot hold .* {total} B"):
            carve(torch.zeros(total - 1, dtype=torch.uint8), sizes)


def test_carve_refuses_a_buffer_that_is_not_bytes() -> None:
    with pytest.raises(LayoutError, match="1-D uint8 buffer"):
        carve(torch.zeros(64, dtype=torch.float32), [16])
    with pytest.raises(LayoutError, match="region 0 size must be an integer >= 0"):
        plan_regions([-1])
    with pytest.raises(LayoutError, match="alignment 300 must be a multiple of 256"):
        plan_regions([1], [300])
    with pytest.raises(LayoutError, match="2 sizes but 1 alignments"):
        plan_regions([1, 2], [0])


@FAST
@given(field_lists())
def test_field_extents_follow_the_walk(fields: list[EntryField]) -> None:
    extents = [(start, end) for _, start, end in field_extents(fields)]
    assert extents == extents_by_hand(fields)
    strictest = max([256] + [f.align for f in fields])
    size = entry_bytes_for(fields)
    last_end = extents[-1][1] if extents else 0
    assert size % strictest == 0 and last_end <= size < last_end + strictest


def test_entry_size_rounds_to_the_strictest_alignment() -> None:
    fields = [EntryField("a", 1, (3,), torch.float16, align=512)]
    assert entry_bytes_for(fields) == 512
    assert entry_bytes_for([EntryField("a", 1, (300,), torch.float16, align=1024)]) == 1024


@FAST
@given(field_lists())
def test_checkpoint_ranges_merge_runs_and_skip_left_out_fields(fields: list[EntryField]) -> None:
    ranges = checkpoint_ranges_for(fields)
    extents = extents_by_hand(fields)
    # By hand: maximal runs of carried fields, from the run's first start to its last end.
    expected, run = [], []
    for f, ext in zip([*fields, None], [*extents, None], strict=True):
        if f is not None and f.in_checkpoint:
            run.append(ext)
            continue
        if run and run[-1][1] > run[0][0]:
            expected.append((run[0][0], run[-1][1] - run[0][0]))
        run = []
    assert ranges == expected
    covered = set()
    for off, n in ranges:
        assert n > 0
        covered.update(range(off, off + n))
    for f, (start, end) in zip(fields, extents, strict=True):
        inside = covered.issuperset(range(start, end))
        touched = bool(covered.intersection(range(start, end)))
        assert inside if f.in_checkpoint else not touched


def test_checkpoint_ranges_merge_padding_into_one_run() -> None:
    fields = [
        EntryField("kv", 1, (3,), torch.float32),
        EntryField("score", 1, (3,), torch.float32, fill=float("-inf")),
        EntryField("ring", 1, (64,), torch.float32, in_checkpoint=False),
        EntryField("idx", 1, (5,), torch.float16),
    ]
    assert checkpoint_ranges_for(fields) == [(0, 256 + 12), (768, 10)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"align": 100}, "alignment 100 must be a multiple of 256"),
        ({"layers": -1}, "layers must be an integer >= 0, got -1"),
        ({"shape": (2, -3)}, "every shape dim must be an integer >= 0, got -3"),
        ({"shape": 5}, "shape must be a sequence of ints"),
        ({"dtype": "float16"}, "dtype must be a torch.dtype"),
        ({"dtype": torch.int32, "fill": float("-inf")}, "fill -inf is not representable in torch.int32"),
        ({"fill": "zero"}, "fill must be a number"),
        ({"name": ""}, "non-empty string"),
        ({"in_checkpoint": 1}, "in_checkpoint must be a bool"),
    ],
)
def test_field_refusals(kwargs: dict, match: str) -> None:
    base = {"name": "x", "layers": 2, "shape": (4,), "dtype": torch.float16}
    with pytest.raises(LayoutError, match=match):
        EntryField(**{**base, **kwargs})


def test_field_normalizes_shape_and_fill() -> None:
    f = EntryField("x", 1, [2, 3], torch.float32, fill=1)
    assert f.shape == (2, 3) and isinstance(f.fill, float)
    assert f.bytes_per_entry == 24 and f.per_layer_bytes == 24


@FAST
@given(field_lists(max_size=4), st.lists(st.sampled_from([256, 512, 768, 4096]), min_size=1,
                                         max_size=2))
def test_plan_field_planes_is_optimal(fields: list[EntryField], widths: list[int]) -> None:
    groups, rows = plan_field_planes(fields, widths)
    assert sorted(f.name for g in groups for f in g) == sorted(f.name for f in fields)
    for group, width in zip(groups, widths, strict=True):
        assert entry_bytes_for(group) <= rows * width
        names = [f.name for f in group]
        assert names == [f.name for f in fields if f.name in names]  # declared order kept
    # Brute force: no assignment fits in fewer rows.
    best = min(
        max(
            math.ceil(entry_bytes_for([f for f, p in zip(fields, code, strict=True) if p == q]) / w)
            for q, w in enumerate(widths)
        )
        for code in itertools.product(range(len(widths)), repeat=len(fields))
    )
    assert rows == best


def test_plan_field_planes_refusals() -> None:
    f = [EntryField("a", 1, (4,), torch.float32)]
    with pytest.raises(LayoutError, match="plane 1 row width 0 B must be a positive integer"):
        plan_field_planes(f, [256, 0])
    with pytest.raises(LayoutError, match="at least one plane"):
        plan_field_planes(f, [])
    many = [EntryField(f"f{i}", 1, (4,), torch.float32) for i in range(17)]
    with pytest.raises(LayoutError, match=r"refusing to enumerate 131072 assignments of 17 fields"):
        plan_field_planes(many, [256, 512])
    with pytest.raises(LayoutError, match=r"duplicate field names \['a'\]"):
        plan_field_planes(f + f, [256])
