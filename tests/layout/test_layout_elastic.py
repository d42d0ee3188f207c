"""Elastic pools: a moving page/state boundary, checked against a per-entry oracle.

The oracle copies entry by entry, plane by plane, with plain slices of a
snapshot — the slow obvious way, sharing nothing with the planner's runs or
the strided copies. Every byte of the allocation is compared, gaps between
entries included, and canary bytes sit on both sides of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from layout_strategies import FAST, field_lists
from pdxfer.layout import (
    ElasticPools,
    EntryField,
    EntryMajorArena,
    LayoutError,
    SplitEntryMajorArena,
    entry_bytes_for,
    plan_resize,
    relocate,
)

CANARY = 0xA5
MARGIN = 2048  # canary bytes before and after; a multiple of every field alignment drawn
PAGE = [EntryField("k", 2, (4, 8), torch.float16), EntryField("v", 2, (4, 8), torch.float16)]
STATE = [
    EntryField("conv", 1, (3, 64), torch.float32),
    EntryField("score", 1, (5, 8), torch.float32, fill=float("-inf")),
]


def _pools_in(whole_size: int, build) -> tuple[torch.Tensor, ElasticPools]:
    """An ElasticPools over a slice of a canaried buffer, its bytes random."""
    whole = torch.full((whole_size,), CANARY, dtype=torch.uint8)
    pools = build(whole)
    gen = torch.Generator().manual_seed(whole_size)
    pools.buf.copy_(torch.randint(0, 256, pools.buf.shape, dtype=torch.uint8, generator=gen))
    return whole, pools


def _oracle(before: torch.Tensor, whole: torch.Tensor, pools: ElasticPools, pool: str,
            old: list[int], new: list[int]) -> torch.Tensor:
    """`before` with each moved entry's bytes copied by hand, slot by slot, plane by plane."""
    want = before.clone()
    for plane, width, nbytes in zip(pools.planes, pools.plane_bytes, pools.entry_bytes(pool),
                                    strict=True):
        base = plane.storage_offset() - whole.storage_offset()
        for o, n in zip(old, new, strict=True):
            want[base + n * width: base + n * width + nbytes] = \
                before[base + o * width: base + o * width + nbytes]
    return want


@st.composite
def setups(draw: st.DrawFn):
    # Pools that hold bytes (an empty entry moves nothing, which proves nothing).
    sized = field_lists(min_size=1, max_size=3).filter(lambda fs: sum(f.bytes_per_entry for f in fs))
    page = draw(sized)
    state = [EntryField(f"s{i}", f.layers, f.shape, f.dtype, align=f.align)
             for i, f in enumerate(draw(sized))]
    planes = None
    if draw(st.booleans()):  # planes narrow enough that a pool's fields may have to split
        widest = max(entry_bytes_for(page), entry_bytes_for(state))
        top = max(1, -(-widest // 1024))
        planes = draw(st.lists(st.integers(1, top + 1).map(lambda k: 1024 * k), min_size=2,
                               max_size=3))
    slots = draw(st.integers(2, 24))
    old = draw(st.integers(0, slots))
    new = draw(st.integers(0, slots).filter(lambda n: n != old))
    vacated = range(new, old) if new < old else range(old, new)
    kept = range(0, new) if new < old else range(new, slots)
    # Entries to move: a stretch of the vacated slots (runs longer than one entry) and
    # scattered ones; entries in use that stay: some of the kept slots. Usually the
    # kept slots have room for the movers; sometimes one entry too few (a refusal).
    moving = draw(st.integers(min(1, len(kept)), min(len(vacated), len(kept))))
    a = draw(st.integers(vacated.start, vacated.stop - moving))
    scattered = draw(st.lists(st.sampled_from(list(vacated)), max_size=moving))
    movers = sorted(set(range(a, a + moving)) | set(scattered))
    room = max(0, len(kept) - len(movers))
    staying = draw(st.lists(st.sampled_from(list(kept)), unique=True, max_size=room)) if room else []
    if kept and draw(st.integers(0, 9)) == 0:
        staying = list(kept)  # no room at all
    used = draw(st.permutations(movers + staying))
    return page, state, slots, planes, old, new, used, (vacated, kept.start, kept.stop)


@FAST
@given(setups())
def test_relocation_moves_exactly_the_used_vacated_entries(setup) -> None:
    page, state, slots, planes, old, new, used, (vacated, keep_lo, keep_hi) = setup
    try:
        size = ElasticPools.allocation_bytes(page, state, slots, plane_bytes=planes)
    except LayoutError as exc:
        assert planes is not None and "do not fit one slot" in str(exc) or "must be a multiple" in str(exc)
        assume(False)
    whole, pools = _pools_in(size + 2 * MARGIN, lambda w: ElasticPools(
        page, state, slots, old, buf=w[MARGIN:MARGIN + size], plane_bytes=planes))
    before = whole.clone()
    moving = sorted(set(used) & set(vacated))
    free = sorted(set(range(keep_lo, keep_hi)) - set(used))
    if len(free) < len(moving):
        with pytest.raises(LayoutError, match=rf"vacates {len(moving)} used .* keeps only {len(free)} free"):
            plan_resize(pools, new, used)
        return
    plan = plan_resize(pools, new, np.array(used, dtype=np.int64))
    moved = relocate(pools, plan)

    pool = "page" if new < old else "state"
    assert moved.old.tolist() == moving
    assert len(set(moved.new.tolist())) == len(moving)
    assert set(moved.new.tolist()) <= set(free)
    # Destinations are the free entries farthest from the boundary.
    assert moved.new.tolist() == (free[:len(moving)] if new < old else free[len(free) - len(moving):])
    # Runs: exactly the pairs, each maximal (no two consecutive runs could merge).
    pairs = [(s + k, d + k) for s, d, n in plan.runs.tolist() for k in range(n)]
    assert pairs == list(zip(moved.old.tolist(), moved.new.tolist(), strict=True))
    for (s0, d0, n0), (s1, d1, _) in zip(plan.runs.tolist(), plan.runs.tolist()[1:], strict=False):
        assert not (s1 == s0 + n0 and d1 == d0 + n0)
    assert plan.nbytes == len(moving) * sum(pools.entry_bytes(pool))

    want = _oracle(before, whole, pools, pool, moved.old.tolist(), moved.new.tolist())
    diff = torch.nonzero(whole != want).flatten().tolist()
    assert not diff, f"{len(diff)} bytes differ from the oracle, first at {diff[0]}"
    assert torch.all(whole[:MARGIN] == CANARY) and torch.all(whole[-MARGIN:] == CANARY)
    assert pools.boundary == new and pools.page.entries == new
    assert pools.state.entries == slots and pools.state.live_entries == slots - new
    assert moved.remap(used).tolist() == [int(moved.new[moving.index(u)]) if u in moving else u
                                          for u in used]


def test_a_narrow_entry_moves_without_writing_the_slot_gap() -> None:
    # Pages (512 B) in 1024 B slots: a run of pages is a strided copy, the gaps stay.
    size = ElasticPools.allocation_bytes(PAGE, STATE, 12)
    whole, pools = _pools_in(size + 2 * MARGIN, lambda w: ElasticPools(
        PAGE, STATE, 12, 8, buf=w[MARGIN:MARGIN + size]))
    assert pools.plane_bytes == [1024] and pools.entry_bytes("page") == [512]
    before = whole.clone()
    plan = plan_resize(pools, 4, [0, 4, 5, 6])
    assert plan.runs.tolist() == [[4, 1, 3]]  # three pages, one copy
    relocate(pools, plan)
    assert torch.equal(whole, _oracle(before, whole, pools, "page", [4, 5, 6], [1, 2, 3]))


def test_the_views_follow_the_move_and_the_arenas_keep_their_planes() -> None:
    pools = ElasticPools(PAGE, STATE, 10, 6, plane_bytes=[1024, 1024])
    assert isinstance(pools.page, SplitEntryMajorArena) and isinstance(pools.state, SplitEntryMajorArena)
    pools.state.view("conv")[:, 6:] = torch.arange(4, dtype=torch.float32)[None, :, None, None]
    planes = [p.data_ptr() for p in pools.planes]
    moved = relocate(pools, plan_resize(pools, 8, [6, 9]))
    assert moved.old.tolist() == [6] and moved.new.tolist() == [8]  # 9 is used, 8 is the free one
    assert [p.data_ptr() for p in pools.planes] == planes
    assert pools.state.view("conv")[0, 8, 0, 0].item() == 0.0  # what entry 6 held
    assert pools.page.entries == 8 and pools.state.live_entries == 2


def test_owned_pools_fill_each_pool_in_its_own_slots_only() -> None:
    pools = ElasticPools(PAGE, STATE, 6, 4)
    score = pools.state.view("score")
    assert torch.isinf(score[:, 4:]).all() and not torch.isinf(score[:, :4]).any()
    assert isinstance(pools.page, EntryMajorArena) and pools.page.entries == 4


def test_moving_nowhere_is_an_empty_plan() -> None:
    pools = ElasticPools(PAGE, STATE, 6, 4)
    plan = plan_resize(pools, 4, [0, 1])
    assert plan.shrinking is None and plan.entries == 0 and plan.runs.shape == (0, 3)
    assert relocate(pools, plan).remap([1, 5]).tolist() == [1, 5]


def test_refusals_name_the_numbers_and_change_nothing() -> None:
    pools = ElasticPools(PAGE, STATE, 8, 4)
    before = pools.buf.clone()
    with pytest.raises(LayoutError, match=r"boundary 9 is past the 8 slots"):
        plan_resize(pools, 9, [])
    with pytest.raises(LayoutError, match=r"used page entry 5 at position 1 is outside the page pool's live entries 0..3"):
        plan_resize(pools, 2, [0, 5])
    with pytest.raises(LayoutError, match=r"used state entry 2 at position 0 is outside the state pool's live entries 4..7"):
        plan_resize(pools, 6, [2])
    with pytest.raises(LayoutError, match=r"vacates 2 used page entries, but the page pool keeps only 1 free of its 2"):
        plan_resize(pools, 2, [0, 2, 3])
    with pytest.raises(LayoutError, match=r"1-D integer array"):
        plan_resize(pools, 2, [0.5])
    stale = plan_resize(pools, 2, [2])
    relocate(pools, plan_resize(pools, 3, []))
    with pytest.raises(LayoutError, match=r"moves the boundary 4 -> 2 of 8 slots, but the pools have boundary 3"):
        relocate(pools, stale)
    assert torch.equal(pools.buf, before)
    with pytest.raises(LayoutError, match=r"state pool.s fields \(1024 B an entry\) do not fit one slot of planes \[256, 256\] B: the best split takes 3 rows"):
        ElasticPools(PAGE, STATE, 4, 2, plane_bytes=[256, 256])
    with pytest.raises(LayoutError, match=r"plane 0 width 1000 B must be a multiple of 256"):
        ElasticPools(PAGE, STATE, 4, 2, plane_bytes=[1000, 1024])
    with pytest.raises(LayoutError, match=r"buffer of 100 B cannot hold"):
        ElasticPools(PAGE, STATE, 4, 2, buf=torch.zeros(100, dtype=torch.uint8))


def test_allocation_bytes_is_what_the_pools_carve() -> None:
    for planes in (None, [1024, 512]):
        size = ElasticPools.allocation_bytes(PAGE, STATE, 5, plane_bytes=planes)
        assert ElasticPools(PAGE, STATE, 5, 2, plane_bytes=planes).buf.numel() == size
    assert entry_bytes_for(STATE) == 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_relocation_on_cuda_matches_the_cpu_one() -> None:
    cpu = ElasticPools(PAGE, STATE, 16, 10)
    gpu = ElasticPools(PAGE, STATE, 16, 10, device="cuda")
    gen = torch.Generator().manual_seed(3)
    cpu.buf.copy_(torch.randint(0, 256, cpu.buf.shape, dtype=torch.uint8, generator=gen))
    gpu.buf.copy_(cpu.buf)
    for pools in (cpu, gpu):
        relocate(pools, plan_resize(pools, 5, [1, 5, 6, 9]))
        relocate(pools, plan_resize(pools, 12, [5, 11, 14]))
    assert torch.equal(gpu.buf.cpu(), cpu.buf)
