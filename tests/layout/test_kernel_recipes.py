"""docs/kernels.md, pinned: entry-major per-layer views, which kernels take them, the NHD recipe."""

from __future__ import annotations

import pytest
import torch
from pdxfer.layout import EntryField, EntryMajorArena, LayerMajorArena

L, P, H, D, PAGES = 2, 16, 8, 64, 6
FIELDS = [EntryField("k", L, (P, H, D), torch.bfloat16), EntryField("v", L, (P, H, D), torch.bfloat16)]


def _arena() -> EntryMajorArena:
    arena = EntryMajorArena(FIELDS, PAGES, "cpu")
    gen = torch.Generator().manual_seed(0)
    for name in ("k", "v"):
        arena.view(name).copy_(torch.randn(L, PAGES, P, H, D, generator=gen).to(torch.bfloat16))
    return arena


def test_per_layer_views_have_page_strides() -> None:
    arena = _arena()
    k = arena.view("k")[1]
    assert k.shape == (PAGES, P, H, D)
    assert k.stride(0) == arena.slot_stride // 2  # the whole entry, not P*H*D
    assert k.stride()[1:] == (H * D, D, 1)
    assert not k.is_contiguous() and k[0].is_contiguous()
    with pytest.raises(RuntimeError):
        k.view(-1, H, D)
    # Layer-major keeps a layer contiguous: there the reshape works.
    assert LayerMajorArena(FIELDS, PAGES, "cpu").view("k")[1].view(-1, H, D).shape == (PAGES * P, H, D)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     block_table: torch.Tensor) -> torch.Tensor:
    """A paged-attention reference addressing the cache as cache[page][token] through strides."""
    keys = k[block_table].flatten(0, 1).float()  # [tokens, H, D]
    vals = v[block_table].flatten(0, 1).float()
    scores = torch.einsum("hd,thd->ht", q.float(), keys) / D ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), vals)


def test_paged_kernel_reads_the_view_through_its_strides() -> None:
    arena = _arena()
    k, v = arena.view("k")[0], arena.view("v")[0]
    q = torch.randn(H, D)
    table = torch.tensor([4, 1, 3])
    got = _paged_attention(q, k, v, table)
    assert torch.equal(got, _paged_attention(q, k.contiguous(), v.contiguous(), table))


def test_nhd_recipe_gathers_and_scatters_exactly_the_named_pages() -> None:
    arena = _arena()
    before = arena.buf.clone()
    k = arena.view("k")[1]
    pages = torch.tensor([5, 2, 3])
    k_nhd = k.index_select(0, pages).flatten(0, 1)
    assert k_nhd.shape == (3 * P, H, D) and k_nhd.is_contiguous()
    assert torch.equal(k_nhd[P:2 * P], k[2])  # token 16 of the gather is token 0 of page 2
    # An NHD kernel that writes K (say, appends RoPE'd keys), then the write-back.
    k_nhd = k_nhd * 2
    k.index_copy_(0, pages, k_nhd.unflatten(0, (-1, P)))
    for page in range(PAGES):
        want = before.view(PAGES, -1)[page].clone()
        if page in pages.tolist():
            layer = EntryMajorArena(FIELDS, 1, "cpu", buf=want.clone())
            layer.view("k")[1].mul_(2)
            want = layer.buf
        assert torch.equal(arena.buf.view(PAGES, -1)[page], want), page
