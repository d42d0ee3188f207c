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
from examples.model import FP8, HybridModel, ModelConfig, deterministic_torch, read_fp8
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


def _ship(src: ModelCaches, dst: ModelCaches, src_pages: np.ndarray, dst_pages: np.ndarray,
          layers: tuple[int, int] | None = None) -> int:
    """Copy kv pages as a transport would: exactly the planned byte ranges, nothing else."""
    (table,) = plan_segments(src.pools["kv"], src_pages, dst_pages, layers=layers)
    for s_off, d_off, n in table.tolist():
        dst.pools["kv"].buf[d_off:d_off + n] = src.pools["kv"].buf[s_off:s_off + n]
    return len(table)


def _dequantised(caches: ModelCaches, layer: int, pages: np.ndarray, n: int) -> torch.Tensor:
    pool = caches.pools["kv"]
    ids = torch.as_tensor(pages)
    scale = pool.view("kv_scale")[layer]
    return torch.stack([read_fp8(pool.view(name)[layer], scale[:, i], ids, n)
                        for i, name in enumerate(("k", "v"))])


@pytest.mark.parametrize("interleaved", [False, True], ids=["entry-major", "layer-interleaved"])
def test_kv_pages_are_fp8_and_carry_their_scales(model: HybridModel, interleaved: bool) -> None:
    by_name = {f.name: f for f in pool_fields(CFG)["kv"]}
    assert by_name["k"].dtype == by_name["v"].dtype == FP8
    scale = by_name["kv_scale"]  # one float32 per (layer, K|V, head), in the page's own entry
    assert (scale.dtype, scale.layers, scale.shape) == (torch.float32, CFG.attn_layers, (2, CFG.heads))
    prompt = _prompt(4, 14)  # a partly filled last page
    sizes = PoolSizes(kv_pages=16, state_entries=1)
    src = ModelCaches(CFG, sizes, model.device, interleaved=interleaved)
    pages = np.array([9, 2, 11, 5])
    model.prefill(src, prompt, pages, 0, 0)
    scales = src.pools["kv"].view("kv_scale")[:, pages]
    assert (scales != scale.fill).all()  # every written page set its own scales
    dst = ModelCaches(CFG, sizes, model.device, interleaved=interleaved)
    dst_pages = np.array([0, 1, 2, 3])
    n = len(prompt)
    if not interleaved:
        # A run of pages is one range, and that range alone carries their scales.
        assert _ship(src, dst, pages, dst_pages) == len(pages)
        layers = range(CFG.attn_layers)
    else:
        # Ship only layer 0: its scales must be inside layer 0's range, layer 1's not.
        assert _ship(src, dst, pages, dst_pages, layers=(0, 1)) == len(pages)
        assert (dst.pools["kv"].view("kv_scale")[1, dst_pages] == scale.fill).all()
        layers = range(1)
    for layer in layers:
        sent = _dequantised(src, layer, pages, n)
        assert torch.isfinite(sent).all() and sent.abs().amax() > 0
        assert torch.equal(_dequantised(dst, layer, dst_pages, n), sent)
