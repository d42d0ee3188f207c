"""Footprint overlap: exact for strided entries, so interleaved planes pass and a shared byte does not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST
from pdxfer.layout.aliasing import Footprint, first_alias


@st.composite
def footprints(draw: st.DrawFn) -> Footprint:
    length = draw(st.integers(0, 12))
    return Footprint.of("", draw(st.sampled_from(["cpu", "cuda:0"])), draw(st.integers(0, 200)),
                        length + draw(st.integers(0, 12)), length, draw(st.integers(0, 6)))


def _bytes(f: Footprint) -> set[tuple[str, int]]:
    return {(f.device, f.start + i * f.stride + b) for i in range(f.count) for b in range(f.length)}


@FAST
@given(st.lists(footprints(), min_size=2, max_size=5))
def test_first_alias_agrees_with_the_byte_sets(fps: list[Footprint]) -> None:
    pairs = [(i, j) for j in range(len(fps)) for i in range(j) if _bytes(fps[i]) & _bytes(fps[j])]
    got = first_alias(fps)
    if not pairs:
        assert got is None
        return
    i, j, address = got
    assert (i, j) == min(pairs, key=lambda p: (p[1], p[0]))
    assert (fps[i].device, address) in _bytes(fps[i]) & _bytes(fps[j])


def test_interleaved_slots_do_not_alias_until_they_share_a_byte() -> None:
    state = Footprint.of("state", "cpu", 0, 1024, 256, 1000)
    pages = Footprint.of("pages", "cpu", 256, 1024, 768, 1000)
    assert first_alias([state, pages]) is None
    assert first_alias([state, Footprint.of("pages", "cpu", 255, 1024, 768, 1000)]) == (0, 1, 255)
    assert first_alias([state, Footprint.of("late", "cpu", 999 * 1024 + 255, 0, 1, 1)]) == (
        0, 1, 999 * 1024 + 255)
