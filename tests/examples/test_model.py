"""The toy model reads and writes its caches correctly, and only through the arenas.

The launcher's "outputs identical" is only worth something if the caches the
model ships are the whole truth: decoding from them must continue the prompt
exactly as re-running the longer prompt would, and bytes the model never
wrote (stale pages, a reused state entry, the unwritten ring slots) must not
leak into a result.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pdxfer.layout import plan_segments

from examples.caches import (
    POOLS,
    LayerMajorBaseline,
    ModelCaches,
    PoolExhausted,
    PoolSizes,
    decode_counts,
    pool_fields,
    prefill_counts,
)
from examples.model import HybridModel, ModelConfig, deterministic_torch
from examples.reference import reference_generate

deterministic_torch()
CFG = ModelConfig()


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(CFG, "cpu")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab) for _ in range(n)]


def _first_token(model: HybridModel, prompt: list[int]) -> int:
    caches = ModelCaches(CFG, PoolSizes(kv_pages=64, state_entries=2), model.device)
    pages = np.arange(prefill_counts(CFG, len(prompt))["kv"])
    return model.prefill(caches, prompt, pages, 0, 0)


def test_decode_from_caches_continues_the_prompt(model: HybridModel) -> None:
    # Token j of the output must be what a fresh prefill of prompt + out[:j]
    # predicts: the decode steps saw the prompt only through the caches.
    prompt = _prompt(1, 13)  # 13 % page_size and 13 % ring are both non-zero
    out = reference_generate(model, prompt, 7)
    assert len(out) == 7
    assert [_first_token(model, prompt + out[:j]) for j in range(7)] == out


def test_bytes_the_model_never_wrote_do_not_matter(model: HybridModel) -> None:
    prompt, gen = _prompt(2, 11), 6
    expected = reference_generate(model, prompt, gen)
    caches = ModelCaches(CFG, PoolSizes(kv_pages=32, state_entries=4), model.device)
    for arena in caches.pools.values():
        arena.buf.fill_(0xFF)  # NaN in every float field: any stray read poisons the output
    need = decode_counts(CFG, len(prompt), gen)
    pages = np.array([17, 3, 29, 8, 21][: need["kv"]])  # scattered, out of order
    model.prefill(caches, prompt, pages[: prefill_counts(CFG, len(prompt))["kv"]], 2, 3)
    assert model.decode(caches, len(prompt), gen, pages, 2, 3) == expected


def test_unwritten_ring_slots_stay_minus_inf_and_lose(model: HybridModel) -> None:
    prompt = _prompt(3, 48)
    caches = ModelCaches(CFG, PoolSizes(kv_pages=16, state_entries=1), model.device)
    model.prefill(caches, prompt, np.arange(12), 0, 0)
    score = caches.pools["state"].view("score_state")[0, 0]
    written = len(prompt) % CFG.ring
    assert written and torch.isfinite(score[:written]).all()
    assert torch.isneginf(score[written:]).all()
    kv = caches.pools["state"].view("kv_state")[0, 0]
    assert torch.isfinite(kv).all()


def test_weights_are_fixed_by_the_seed() -> None:
    a, b = HybridModel(CFG), HybridModel(CFG)
    assert a.digest() == b.digest()
    assert HybridModel(ModelConfig(seed=CFG.seed + 1)).digest() != a.digest()


def test_allocator_refuses_before_taking_and_names_the_flag() -> None:
    caches = ModelCaches(CFG, PoolSizes(kv_pages=4, state_entries=2), "cpu")
    with pytest.raises(PoolExhausted, match=r"'kv' has 4 of 4 entries free, a request needs 5.*--kv-pages"):
        caches.allocate({"kv": 5, "state": 1, "aux": 1})
    assert caches.allocators["state"].free == 2  # nothing was taken
    idx = caches.allocate({"kv": 2, "state": 1, "aux": 1})
    caches.free(idx)
    with pytest.raises(RuntimeError, match="freed twice"):
        caches.free(idx)


def test_layer_major_baseline_is_planned_over_the_same_fields() -> None:
    caches = ModelCaches(CFG, PoolSizes(kv_pages=32, state_entries=4), "cpu")
    baseline = LayerMajorBaseline(caches)
    src = {"kv": np.arange(4, 10), "state": np.array([1]), "aux": np.array([1])}
    dst = {"kv": np.arange(20, 26), "state": np.array([3]), "aux": np.array([3])}
    entries = {name: caches.pools[name].entries for name in POOLS}
    entry_major = sum(len(t) for n in POOLS for t in plan_segments(caches.pools[n], src[n], dst[n]))
    assert entry_major == 3  # one contiguous run per pool
    # Layer-major splits every run once per field and layer.
    per_run = sum(f.layers for fields in pool_fields(CFG).values() for f in fields)
    assert baseline.segments(src, dst, entries) == per_run
