"""The vectorised planner paths, above 64 indices, against a plain-Python oracle.

Issue #9 item 8: `plan_segments` takes other paths past `_SMALL` (64) pairs —
`_check_unique` (strictly-increasing shortcut, dense bitmap, sort),
`_source_order` (dense scatter or stable argsort) and the multi-range
`_plan_strided` — and the small-arena property tests never reach them. Here
arenas have thousands of entries (sparse and dense index spaces), requests
hundreds of indices, and the oracle lists rows one entry and range at a time,
sorts stably by source and merges neighbours: the planned table must equal it
row for row, and a repeated destination must be refused whatever path finds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pdxfer.layout import EntryField, EntryMajorArena, LayoutError, plan_segments

LARGE = settings(max_examples=40, deadline=None)

# three fields, the middle one left out of checkpoints: a checkpoint plan has two ranges per entry
FIELDS = [
    EntryField("a", 1, (8,), torch.float32, in_checkpoint=True),
    EntryField("b", 1, (16,), torch.float32, in_checkpoint=False),
    EntryField("c", 2, (4,), torch.float16, in_checkpoint=True),
]
_ARENAS: dict[int, EntryMajorArena] = {}


def arena(entries: int) -> EntryMajorArena:
    if entries not in _ARENAS:
        _ARENAS[entries] = EntryMajorArena(FIELDS, entries, "cpu")
    return _ARENAS[entries]


def oracle(a: EntryMajorArena, src: list[int], dst: list[int], checkpoint: bool) -> list[list[int]]:
    """Rows entry by entry and range by range, stably sorted by source, neighbours merged."""
    ranges = [(o, n) for o, n in (a.checkpoint_ranges if checkpoint else [(0, a.entry_bytes)]) if n]
    rows: list[list[int]] = []
    for s, d in sorted(zip(src, dst, strict=True), key=lambda p: p[0]):
        for off, n in ranges:
            row = [s * a.slot_stride + off, d * a.slot_stride + off, n]
            last = rows[-1] if rows else None
            if last and last[0] + last[2] == row[0] and last[1] + last[2] == row[1]:
                last[2] += n
            else:
                rows.append(row)
    return rows


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray, bool]:
    entries = draw(st.sampled_from([1000, 3000, 20000]))  # 20000: sparse for a few hundred indices
    n = draw(st.integers(65, 600))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = draw(st.sampled_from(["sorted", "shuffled", "reversed", "runs", "repeated-src"]))
    dst = rng.choice(entries, n, replace=False)
    if shape == "repeated-src":
        src = rng.integers(0, entries, n)
        src[: n // 3] = src[0]  # many entries broadcast from one source
        rng.shuffle(src)
    elif shape == "runs":
        start = int(rng.integers(0, entries - n))
        src = np.arange(start, start + n)
        dst = np.arange(0, n) + int(rng.integers(0, entries - n))
        cut = int(rng.integers(1, n))
        src = np.concatenate([src[cut:], src[:cut]])  # two runs, out of order
        dst = np.concatenate([dst[cut:], dst[:cut]])
    else:
        src = rng.choice(entries, n, replace=False)
        if shape == "sorted":
            src.sort()
        elif shape == "reversed":
            src[::-1].sort()
    return entries, src.astype(np.int64), dst.astype(np.int64), draw(st.booleans())


@LARGE
@given(requests())
def test_large_requests_plan_exactly_the_oracle_table(req) -> None:
    entries, src, dst, checkpoint = req
    a = arena(entries)
    (table,) = plan_segments(a, src, dst, checkpoint=checkpoint)
    want = np.array(oracle(a, src.tolist(), dst.tolist(), checkpoint), dtype=np.int64).reshape(-1, 3)
    assert table.shape == want.shape and np.array_equal(table, want)


@LARGE
@given(requests(), st.integers(0, 2**32 - 1))
def test_a_repeated_destination_is_refused_on_every_large_path(req, seed: int) -> None:
    entries, src, dst, _ = req
    rng = np.random.default_rng(seed)
    i, j = rng.choice(dst.size, 2, replace=False)
    dst = dst.copy()
    dst[j] = dup = int(dst[i])
    if rng.integers(2):
        dst.sort()  # sorted with a tie: the "strictly increasing" shortcut must not pass it
    with pytest.raises(LayoutError, match=rf"destination index {dup} appears 2 times"):
        plan_segments(arena(entries), src, dst)


def test_the_large_paths_are_the_ones_exercised() -> None:
    # pins the premise: past 64 pairs plan_segments leaves the small-request path
    from pdxfer.layout import segments

    assert segments._SMALL == 64
