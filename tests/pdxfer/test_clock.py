"""The engine clock (pdxfer.clock): virtual time moves only when told, and wakes its watchers."""

from __future__ import annotations

import math
import time

import pytest

from pdxfer.clock import MONOTONIC, ManualClock


def test_a_manual_clock_moves_only_by_advance_and_wakes_each_watcher_until_unwatched() -> None:
    clock = ManualClock(start=5.0)
    woken: list[str] = []
    stop_a = clock.watch(lambda: woken.append("a"))
    clock.watch(lambda: woken.append("b"))
    assert clock.now() == 5.0
    time.sleep(0.01)
    assert clock.now() == 5.0  # real time flowing does not move it
    clock.advance(2.5)
    assert clock.now() == 7.5
    assert sorted(woken) == ["a", "b"]
    stop_a()
    clock.advance(0.0)
    assert sorted(woken) == ["a", "b", "b"]


@pytest.mark.parametrize("seconds", [-0.001, math.nan])
def test_a_manual_clock_refuses_to_go_back(seconds: float) -> None:
    clock = ManualClock()
    with pytest.raises(ValueError, match=r"only moves forward.*pass seconds >= 0"):
        clock.advance(seconds)
    assert clock.now() == 1000.0


def test_the_real_clock_is_monotonic_time_and_never_wakes_anyone() -> None:
    before = time.monotonic()
    assert before <= MONOTONIC.now() <= time.monotonic()
    MONOTONIC.watch(lambda: pytest.fail("a real clock never jumps"))()
