"""The decode's proof over streamed layer ranges (#33): a set of layers per span, never a count.

`DecodeLife(depth=4)`: each whole chunk adds its layers to its span's set;
Success needs every chunk through the last whole AND no span short of a
layer. Scripted notifies, no engine.
"""

from __future__ import annotations

import re

import pytest

from pdxfer import KVPoll
from pdxfer.lifecycle import DecodeLife, DPhase, Finish, Send, Timing
from pdxfer.protocol import Abort, Done, Expect

T = Timing(wait=10.0, grace=1.0)


def announced(depth: int = 4) -> DecodeLife:
    life = DecodeLife("r", 5, Expect("r", 5, {}), T, 0.0, depth=depth)
    life.on_link_ready(0.0)
    return life


def test_success_comes_with_the_last_layer_range_whatever_order_the_ranges_land_in() -> None:
    life = announced()
    assert life.on_landed(2, 0, 1, True, 0.1, 1, 2, 4) == []  # the last range of span 1 first
    assert life.on_landed(0, 0, 1, False, 0.2, 0, 0, 0) == []  # span 0 whole (hi 0: every layer)
    assert life.poll is KVPoll.Transferring
    assert life.on_landed(1, 0, 2, False, 0.3, 1, 0, 2) == []
    assert life.poll is KVPoll.Transferring, "Success before span 1's layers 0..1 were whole"
    assert life.on_landed(1, 1, 2, False, 0.4, 1, 0, 2) == [Finish(True), Send(Done("r", 5))]


def test_every_chunk_whole_is_not_enough_while_a_span_lacks_a_layer() -> None:
    """A prefill that moved on to the next entries without their last layers: never Success."""
    life = announced()
    assert life.on_landed(0, 0, 1, False, 0.1, 0, 0, 3) == []  # span 0: layers 0..2 only
    assert life.on_landed(1, 0, 1, True, 0.2, 1, 0, 0) == []  # span 1 whole, the last chunk
    assert life.phase is DPhase.RECEIVING and life.partial == {0}


@pytest.mark.parametrize("notifies, named", [
    ([(0, 0, 1, False, 0, 0, 2), (1, 0, 1, True, 0, 1, 4)], r"layers \[1, 4\) of span 0 overlap"),
    ([(0, 0, 1, True, 0, 2, 5)], r"layer range inside the pools' 4 layers"),
    ([(0, 0, 1, True, -1, 0, 0)], "a span >= 0"),
    ([(0, 0, 2, False, 0, 0, 2), (0, 1, 2, True, 0, 2, 4)],
     r"chunk 0 was announced as span 0 layers \[0, 2\)"),
])
def test_an_impossible_layer_range_fails_the_request_by_name(notifies, named) -> None:
    life = announced()
    effects: list = []
    for chunk, part, parts, last, span, lo, hi in notifies:
        effects = life.on_landed(chunk, part, parts, last, 0.1, span, lo, hi)
    aborts = [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, Abort)]
    assert aborts and life.phase is DPhase.ABORTING, effects
    assert re.search(named, aborts[0].reason), aborts[0].reason
