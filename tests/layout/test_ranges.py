"""adopt_ranges: raw (pointer, length) ranges become a pool only if they match the declaration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer.layout import (
    EntryField,
    LayoutError,
    PerLayerArena,
    adopt_ranges,
    arena_buffers,
    describe,
    fingerprint,
    plan_segments,
)

L, P, H, D = 3, 4, 2, 8


def _buffers(pages: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {name: [torch.randn(pages * P, H, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
            for name in ("k", "v")}


def _fields() -> list[EntryField]:
    return [EntryField(n, L, (P, H, D), torch.bfloat16) for n in ("k", "v")]


def _ranges(bufs: dict[str, list[torch.Tensor]], item: bool = True) -> dict[str, list[tuple]]:
    return {n: [(t.data_ptr(), t.nbytes, t[:P].nbytes) if item else (t.data_ptr(), t.nbytes)
                for t in ts] for n, ts in bufs.items()}


def test_the_pool_over_ranges_is_the_pool_over_the_tensors() -> None:
    bufs = _buffers(6)
    adopted = adopt_ranges(_fields(), _ranges(bufs))
    direct = PerLayerArena(bufs, entry_rows=P)
    assert isinstance(adopted, PerLayerArena) and adopted.entries == 6
    assert fingerprint(describe(adopted)) == fingerprint(describe(direct))
    for a, b in zip(arena_buffers(adopted), arena_buffers(direct), strict=True):
        assert (a.data_ptr(), a.numel()) == (b.data_ptr(), b.numel())
    src, dst = np.array([5, 1]), np.array([0, 3])
    for ta, tb in zip(plan_segments(adopted, src, dst), plan_segments(direct, src, dst), strict=True):
        assert np.array_equal(ta, tb)
    # a view over the engine's memory, not a copy: a write through the pool is seen by the engine
    adopted.view("v", 2)[4].fill_(7)
    assert torch.all(bufs["v"][2][4 * P:5 * P] == 7)


def test_a_row_pool_with_one_row_per_entry() -> None:
    rows = torch.zeros(10, 16, dtype=torch.int32)
    pool = adopt_ranges([EntryField("ids", 1, (1, 16), torch.int32)],
                        {"ids": [(rows.data_ptr(), rows.nbytes, rows[0].nbytes)]})
    assert pool.entries == 10


@pytest.mark.parametrize(("change", "match"), [
    (lambda r: r.update(k=r["k"][:2]), r"field 'k' declares 3 layers but 2 ranges"),
    (lambda r: r.pop("v"), r"ranges name fields \['k'\] but the declaration has \['k', 'v'\]"),
    (lambda r: r.update(x=[]), r"ranges name fields \['k', 'v', 'x'\]"),
    (lambda r: r["k"].__setitem__(1, (r["k"][1][0], r["k"][1][1], 999)),
     r"field 'k' layer 1: the engine says one entry is 999 B, the declaration \[4, 2, 8\] "
     r"torch.bfloat16 makes it 128 B"),
    (lambda r: r["v"].__setitem__(0, (r["v"][0][0] + 1, r["v"][0][1] - 2)),
     r"field 'v' layer 0: pointer 0x[0-9a-f]+ is not aligned to torch.bfloat16"),
    (lambda r: r["v"].__setitem__(0, (r["v"][0][0], r["v"][0][1] - 2)),
     r"field 'v' layer 0: 766 B is not a whole number of 128 B entries \(5 entries \+ 126 B\)"),
    (lambda r: r["k"].__setitem__(2, (r["k"][2][0], r["k"][2][1] - 128)),
     r"field 'k': its ranges hold \[5, 6\] entries"),
    (lambda r: r["v"].__setitem__(1, r["v"][0]), r"field 'v' layer 0 and field 'v' layer 1 overlap"),
    (lambda r: r["k"].__setitem__(0, (0, 128)), r"field 'k' layer 0: pointer must be an integer >= 1"),
    (lambda r: r["k"].__setitem__(0, (r["k"][0][0], 0)), r"field 'k' layer 0: length must be an integer >= 1"),
    (lambda r: r["k"].__setitem__(0, 5), r"a range is \(ptr, nbytes\) or \(ptr, nbytes, item_bytes\)"),
])
def test_ranges_that_disagree_with_the_declaration_are_refused(change, match) -> None:
    bufs = _buffers(6)
    ranges = {n: list(v) for n, v in _ranges(bufs).items()}
    change(ranges)
    with pytest.raises(LayoutError, match=match):
        adopt_ranges(_fields(), ranges)


def test_fields_of_different_entry_counts_or_rows_are_refused() -> None:
    bufs = _buffers(6)
    other = torch.zeros(5 * P, H, D, dtype=torch.bfloat16)
    ranges = _ranges(bufs, item=False)
    ranges["s"] = [(other.data_ptr(), other.nbytes)]
    fields = [*_fields(), EntryField("s", 1, (P, H, D), torch.bfloat16)]
    with pytest.raises(LayoutError, match=r"fields hold different entry counts \{'k': 6, 'v': 6, 's': 5\}"):
        adopt_ranges(fields, ranges)
    fields[2] = EntryField("s", 1, (1, H, D), torch.bfloat16)
    with pytest.raises(LayoutError, match=r"must start with the rows of one entry, and the same for all"):
        adopt_ranges(fields, ranges)


def test_a_field_declared_with_another_dtype_of_the_same_size_is_told_apart_by_describe() -> None:
    # The bytes cannot tell bf16 from fp16; the declaration can, and the handshake compares it.
    bufs = _buffers(6)
    as_fp16 = [EntryField(n, L, (P, H, D), torch.float16) for n in ("k", "v")]
    a = describe(adopt_ranges(_fields(), _ranges(bufs)))
    b = describe(adopt_ranges(as_fp16, _ranges(bufs)))
    assert fingerprint(a) != fingerprint(b)
