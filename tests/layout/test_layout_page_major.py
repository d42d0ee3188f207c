"""Page-major pools put every byte where SGLang's builders put it.

The reference below is SGLang's placement written as an address formula per
element (from SGLang's page-major docstrings and strides), independent of our views:
values are written through our views and read back from the raw bytes at the
reference addresses, and the views together must tile the pool exactly.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import FAST
from pdxfer.layout import (
    LayoutError,
    PageMajorMambaArena,
    PageMajorMHAArena,
    build_page_major_mamba_views,
    build_page_major_mha_views,
    describe,
    fingerprint,
    mamba_entry_bytes,
    mha_entry_bytes,
    plan_segments,
)

CANARY = 0xA5


def _grid(shape: tuple[int, ...], strides_bytes: tuple[int, ...]) -> np.ndarray:
    """Byte address (minus base) of every element of a `shape` array with these byte strides."""
    addr = np.zeros(shape, dtype=np.int64)
    for axis, (n, stride) in enumerate(zip(shape, strides_bytes, strict=True)):
        index = np.arange(n, dtype=np.int64) * stride
        addr = addr + index.reshape((1,) * axis + (n,) + (1,) * (len(shape) - axis - 1))
    return addr


def _contiguous_bytes(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) * itemsize for i in range(len(shape)))


def ref_mha_addresses(L, H, D, Dv, itemsize, ps, pages, anchor):
    """SGLang: page p, layer l, K at l*ps*(k_row+v_row), V after ps K rows."""
    k_row, v_row = H * D * itemsize, H * Dv * itemsize
    page_bytes = ps * L * (k_row + v_row)
    ks, vs = [], []
    for layer in range(L):
        k_base = anchor + layer * ps * (k_row + v_row)
        v_base = k_base + ps * k_row
        ks.append(k_base + _grid((pages, ps, H, D), (page_bytes, k_row, D * itemsize, itemsize)))
        vs.append(v_base + _grid((pages, ps, H, Dv), (page_bytes, v_row, Dv * itemsize, itemsize)))
    return ks, vs, page_bytes


def ref_mamba_addresses(L, conv_shapes, conv_size, temporal_shape, temporal_size, slots, anchor):
    """SGLang: per slot [conv[0] x layers][conv[1] x layers]...[temporal x layers]."""
    regions = [(tuple(s), conv_size) for s in conv_shapes] + [(tuple(temporal_shape), temporal_size)]
    entry = sum(L * math.prod(s) * size for s, size in regions)
    out, offset = [], 0
    for shape, size in regions:
        numel = math.prod(shape)
        strides = (numel * size, entry) + _contiguous_bytes(shape, size)
        out.append(anchor + offset + _grid((L, slots) + shape, strides))
        offset += L * numel * size
    return out, entry


def _check_views(raw: torch.Tensor, views: list[torch.Tensor], addresses: list[np.ndarray],
                 lo: int, hi: int) -> None:
    """Write distinct values through `views`; find each at its reference address in `raw`."""
    raw.fill_(CANARY)
    expected = np.full(raw.numel(), CANARY, dtype=np.uint8)
    counter = 1
    for view, addr in zip(views, addresses, strict=True):
        assert tuple(view.shape) == addr.shape
        values = (torch.arange(view.numel()) + counter).reshape(view.shape) % 251 + 1
        counter += view.numel()
        typed = values.to(view.dtype)
        view.copy_(typed)
        data = typed.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(-1, view.element_size())
        for b in range(view.element_size()):
            expected[addr.reshape(-1) + b] = data[:, b]
    assert np.array_equal(raw.numpy(), expected)
    # The views tile the pool exactly: every byte of [lo, hi) once, nothing else.
    covered = np.concatenate([
        (a.reshape(-1, 1) + np.arange(v.element_size())).reshape(-1)
        for v, a in zip(views, addresses, strict=True)
    ])
    assert np.array_equal(np.sort(covered), np.arange(lo, hi))


mha_geometry = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 8), st.integers(1, 8),
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
    st.integers(1, 4), st.integers(0, 4),
)


@FAST
@given(mha_geometry, st.integers(0, 6), st.integers(0, 3))
def test_mha_views_land_where_sglang_puts_them(geometry, anchor_elems: int, lead_elems: int) -> None:
    L, H, D, Dv, dtype, ps, pages = geometry
    size = dtype.itemsize
    anchor, lead = anchor_elems * size, lead_elems * size
    ks, vs, page_bytes = ref_mha_addresses(L, H, D, Dv, size, ps, pages, lead + anchor)
    assert mha_entry_bytes(layer_num=L, head_num=H, head_dim=D, v_head_dim=Dv, itemsize=size) * ps == page_bytes
    host = torch.zeros(lead + anchor + pages * page_bytes + 2 * size, dtype=torch.uint8)
    raw = host[lead:]  # a raw that is itself a slice: anchor counts from ITS start
    k, v = build_page_major_mha_views(
        raw, layer_num=L, head_num=H, head_dim=D, v_head_dim=Dv, store_dtype=dtype,
        page_size=ps, num_pages=pages, anchor_bytes=anchor,
    )
    views = [t for pair in zip(k, v, strict=True) for t in pair]
    addrs = [a for pair in zip(ks, vs, strict=True) for a in pair]
    _check_views(host, views, addrs, lead + anchor, lead + anchor + pages * page_bytes)


mamba_geometry = st.tuples(
    st.integers(1, 3),
    st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=2), min_size=1, max_size=2),
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.sampled_from([torch.float16, torch.float32]),
    st.integers(0, 4),
)


@FAST
@given(mamba_geometry, st.integers(0, 4))
def test_mamba_views_land_where_sglang_puts_them(geometry, anchor_words: int) -> None:
    L, conv_shapes, conv_dtype, t_shape, t_dtype, slots = geometry
    anchor = 4 * anchor_words
    addrs, entry = ref_mamba_addresses(L, conv_shapes, conv_dtype.itemsize, t_shape,
                                       t_dtype.itemsize, slots, anchor)
    kwargs = dict(layer_num=L, conv_state_shapes=conv_shapes, conv_dtype=conv_dtype,
                  temporal_state_shape=t_shape, temporal_dtype=t_dtype)
    assert mamba_entry_bytes(**kwargs) == entry
    raw = torch.zeros(anchor + slots * entry + 8, dtype=torch.uint8)
    conv_off = L * sum(math.prod(s) for s in conv_shapes) * conv_dtype.itemsize
    if conv_off % t_dtype.itemsize or entry % t_dtype.itemsize or entry % conv_dtype.itemsize:
        with pytest.raises(LayoutError, match="is not a multiple of"):
            build_page_major_mamba_views(raw, max_slots=slots, anchor_bytes=anchor, **kwargs)
        return
    conv, temporal = build_page_major_mamba_views(raw, max_slots=slots, anchor_bytes=anchor, **kwargs)
    _check_views(raw, [*conv, temporal], addrs, anchor, anchor + slots * entry)


def test_builders_keep_sglang_signatures() -> None:
    mha = inspect.signature(build_page_major_mha_views).parameters
    assert list(mha) == ["raw", "layer_num", "head_num", "head_dim", "v_head_dim", "store_dtype",
                         "page_size", "num_pages", "anchor_bytes"]
    mamba = inspect.signature(build_page_major_mamba_views).parameters
    assert list(mamba) == ["raw", "layer_num", "conv_state_shapes", "conv_dtype",
                           "temporal_state_shape", "temporal_dtype", "max_slots", "anchor_bytes"]
    for params in (mha, mamba):
        assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "raw")
        assert params["anchor_bytes"].default == 0


def test_pool_pages_ship_as_runs_and_fingerprint_ignores_placement() -> None:
    kw = dict(layer_num=2, head_num=2, head_dim=4, v_head_dim=4, store_dtype=torch.float16, page_size=4)
    raw = torch.zeros(4096, dtype=torch.uint8)
    a = PageMajorMHAArena(**kw, num_pages=6, device="cpu")
    b = PageMajorMHAArena(**kw, num_pages=3, device="cpu", buf=raw, anchor_bytes=512)
    assert b.buf.storage_offset() == 512 and b.raw is raw
    assert a.entries == 6 and a.entry_bytes == a.slot_stride == 2 * 4 * (8 + 8) * 2
    assert fingerprint(describe(a)) == fingerprint(describe(b))
    assert describe(a)["page"]["page_size"] == 4
    (table,) = plan_segments(a, [1, 2, 4], [0, 1, 2], dst_entries=3)
    pb = a.entry_bytes
    assert table.tolist() == [[pb, 0, 2 * pb], [4 * pb, 2 * pb, pb]]
    m = PageMajorMambaArena(2, [(3, 4)], torch.float16, (2, 2), torch.float32, 5, "cpu")
    assert len(m.conv) == 1 and m.temporal.shape == (2, 5, 2, 2)
    assert describe(m)["kind"] == "page_major_mamba"
    (table,) = plan_segments(m, [4], [0])
    assert table.tolist() == [[4 * m.entry_bytes, 0, m.entry_bytes]]


MHA = dict(layer_num=1, head_num=1, head_dim=4, v_head_dim=4, store_dtype=torch.float16,
           page_size=2, num_pages=2)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: build_page_major_mha_views(torch.zeros(128, dtype=torch.uint8), anchor_bytes=1, **MHA),
         r"anchor_bytes 1 \(raw at storage offset 0\) puts the pool at byte 1, not a multiple of the 2 B"),
        (lambda: build_page_major_mha_views(torch.zeros(128, dtype=torch.uint8)[1:], **MHA),
         r"anchor_bytes 0 \(raw at storage offset 1\)"),
        (lambda: build_page_major_mha_views(torch.zeros(60, dtype=torch.uint8), anchor_bytes=8, **MHA),
         "raw of 60 B cannot hold a 64 B pool at anchor_bytes 8; it needs at least 72 B"),
        (lambda: build_page_major_mha_views(torch.zeros(64, dtype=torch.float16), **MHA),
         "raw must be a 1-D uint8 tensor"),
        (lambda: build_page_major_mha_views(torch.zeros(64, dtype=torch.uint8), **{**MHA, "page_size": 0}),
         "page_size must be an integer >= 1, got 0"),
        (lambda: PageMajorMHAArena(**MHA, device="cpu", anchor_bytes=64),
         "anchor_bytes 64 places a pool inside a caller's buffer"),
        (lambda: build_page_major_mamba_views(
            torch.zeros(256, dtype=torch.uint8), layer_num=1, conv_state_shapes=[(1, 3)],
            conv_dtype=torch.float16, temporal_state_shape=(2,), temporal_dtype=torch.float32,
            max_slots=2),
         r"field 'temporal' \(torch.float32, 4 B elements\): entry stride 14 B is not a multiple of 4"),
        (lambda: mha_entry_bytes(layer_num=1, head_num=1, head_dim=1, v_head_dim=1, itemsize=3),
         "itemsize 3 must be one of"),
    ],
)
def test_page_major_refusals(build, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        build()
