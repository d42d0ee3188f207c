"""Pools whose bytes alias are refused when the engine registers them, naming both (#25 item 2).

Two pools over one byte would each receive the other's requests: one of them
reports Success while holding the other's bytes, and which one wins differs
by backend. The engine refuses before registering anything, on either side,
over every backend; pools that share an allocation without sharing a byte
(carved apart, or interleaved in one plane: `test_engine_flow`) stay accepted.
"""

from __future__ import annotations

import pytest
import torch
from pdxfer_testkit import STATE_FIELDS, config

from pdxfer import DecodeEngine, LayoutError, PrefillEngine, layout


def _same_arena_twice() -> dict:
    arena = layout.EntryMajorArena(STATE_FIELDS, 8, "cpu")
    return {"a": arena, "b": arena}


def _two_arenas_over_one_buffer() -> dict:
    a = layout.EntryMajorArena(STATE_FIELDS, 8, "cpu")
    return {"a": a, "b": layout.EntryMajorArena(STATE_FIELDS, 4, "cpu", buf=a.buf[4 * a.slot_stride:])}


def _per_layer_pools_sharing_a_layer() -> dict:
    t = [torch.zeros(16, 2, 8) for _ in range(2)]
    return {"kv": layout.PerLayerArena({"k": t}, entry_rows=4),
            "more": layout.PerLayerArena({"k": [torch.zeros(16, 2, 8), t[1]]}, entry_rows=4)}


def _layer_major_over_an_entry_major() -> dict:
    a = layout.EntryMajorArena(STATE_FIELDS, 8, "cpu")
    return {"a": a, "lm": layout.LayerMajorArena(STATE_FIELDS, 2, "cpu", buf=a.buf[:a.slot_stride * 2])}


CASES = [
    (_same_arena_twice, r"pool 'b' shares memory with pool 'a'"),
    (_two_arenas_over_one_buffer, r"pool 'b' shares memory with pool 'a'"),
    (_per_layer_pools_sharing_a_layer,
     r"pool 'more' field 'k' layer 1 shares memory with pool 'kv' field 'k' layer 1"),
    (_layer_major_over_an_entry_major, r"pool 'lm' shares memory with pool 'a'"),
]


@pytest.mark.parametrize(("build", "match"), CASES,
                         ids=["same-arena", "one-buffer", "per-layer", "layer-major"])
@pytest.mark.parametrize("role", [PrefillEngine, DecodeEngine], ids=["prefill", "decode"])
def test_pools_sharing_bytes_are_refused_naming_both(backend: str, role, build, match: str) -> None:
    with pytest.raises(LayoutError, match=match + r".*give each pool its own memory"):
        role(build(), config(backend)).close()
