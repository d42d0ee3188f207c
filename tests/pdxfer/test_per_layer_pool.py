"""An engine's per-layer KV tensors as ONE pool: registered once each, one description, one plan.

Over every backend: the named pages land in every tensor, every other byte of
every tensor stays as it was, and the transfers per request are one per
registered allocation the tensors live in (2L for SGLang's separate
per-layer allocations, 1 when the engine carved them out of one buffer).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer_testkit import STATE_FIELDS, config

from pdxfer import DecodeEngine, LayoutMismatchError, PrefillEngine, RequestFailed, layout

L, P, H, D = 4, 16, 2, 32


def _tensors(pages: int, seed: int, one_allocation: bool) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = pages * P
    if one_allocation:  # views of one buffer, as an engine that pre-carves its pool has them
        whole = torch.randn(2 * L, rows, H, D, generator=gen).to(torch.bfloat16)
        return {"k": list(whole[:L]), "v": list(whole[L:])}
    return {n: [torch.randn(rows, H, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
            for n in ("k", "v")}


def _pools(pages: int, seed: int, one_allocation: bool) -> dict:
    return {"kv": layout.PerLayerArena(_tensors(pages, seed, one_allocation), entry_rows=P),
            "state": layout.EntryMajorArena(STATE_FIELDS, 8, "cpu")}


@pytest.mark.parametrize("one_allocation", [False, True], ids=["per-layer-allocs", "one-alloc"])
def test_per_layer_pool_ships_pages_and_nothing_else(backend: str, one_allocation: bool) -> None:
    src_pools, dst_pools = _pools(32, 1, one_allocation), _pools(48, 2, one_allocation)
    before = {(n, layer): dst_pools["kv"].view(n, layer).clone() for n in ("k", "v") for layer in range(L)}
    src_pages, dst_pages = np.array([7, 8, 9, 2, 30]), np.array([40, 41, 42, 0, 5])
    prefill = PrefillEngine(src_pools, config(backend))
    decode = DecodeEngine(dst_pools, config(backend))
    try:
        assert prefill.regions == (2 if one_allocation else 2 * L + 1)
        decode.expect("r", prefill.bootstrap_address, {"kv": dst_pages, "state": [3]})
        prefill.send("r", {"kv": src_pages, "state": [5]})
        decode.wait("r", 30.0)
        prefill.wait("r", 30.0)
        stats = decode.stats("r")
    finally:
        decode.close()
        prefill.close()
    # kv: one run 7..9 -> 40..42, plus 2 -> 0 and 30 -> 5: 3 segments per tensor; state: 1.
    assert stats.segments == 2 * L * 3 + 1
    assert stats.transfers == (2 if one_allocation else 2 * L + 1)
    for (name, layer), old in before.items():
        want = old.clone()
        want[torch.as_tensor(dst_pages)] = src_pools["kv"].view(name, layer)[torch.as_tensor(src_pages)]
        assert torch.equal(dst_pools["kv"].view(name, layer), want), (name, layer)


def test_per_layer_pools_of_another_shape_are_refused_by_name(backend: str) -> None:
    src = {"kv": layout.PerLayerArena(_tensors(8, 1, False), entry_rows=P)}
    dst = {"kv": layout.PerLayerArena({"k": _tensors(8, 2, False)["k"]}, entry_rows=P)}
    prefill = PrefillEngine(src, config(backend))
    decode = DecodeEngine(dst, config(backend))
    try:
        prefill.send("r", {"kv": [1]})
        decode.expect("r", prefill.bootstrap_address, {"kv": [0]})
        with pytest.raises(RequestFailed, match=r"pool 'kv': field count differs: 2 vs 1") as info:
            decode.wait("r", 30.0)
        assert isinstance(info.value.__cause__, LayoutMismatchError)
    finally:
        decode.close()
        prefill.close()
