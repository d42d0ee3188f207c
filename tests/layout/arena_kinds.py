"""One arena of every kind, built the same way on every run: the fixtures the
protocol pin (`test_arena_protocol.py`) hashes descriptions and tables of."""

from __future__ import annotations

import torch
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    PageMajorMambaArena,
    PageMajorMHAArena,
    PerLayerArena,
    ShardMajorArena,
    SplitEntryMajorArena,
)


def kind_fields() -> list[EntryField]:
    return [
        EntryField("kv_state", 2, (4, 8), torch.float32),
        EntryField("score_state", 2, (4, 8), torch.float32, fill=float("-inf")),
        EntryField("ring", 1, (16,), torch.bfloat16, align=512, in_checkpoint=False),
        EntryField("k", 3, (2, 4), torch.float16, tp_axis=0),
    ]


def every_kind() -> dict[str, object]:
    """name -> arena (cpu, so segment tables can be planned), one per kind and variant."""
    f = kind_fields()
    per_layer = {"k": [torch.zeros(12, 2, 4, dtype=torch.float16) for _ in range(3)],
                 "v": [torch.zeros(12, 2, 4, dtype=torch.float16) for _ in range(3)]}
    return {
        "entry_major": EntryMajorArena(f, 6, "cpu"),
        "entry_major_strided": EntryMajorArena(f, 6, "cpu", slot_stride=4096 + 1024, live_entries=4),
        "layer_major": LayerMajorArena([x for x in f if not x.fill], 6, "cpu"),
        "split_entry_major": SplitEntryMajorArena(
            [EntryMajorArena(f[:2], 6, "cpu", live_entries=5), EntryMajorArena(f[2:], 6, "cpu", live_entries=5)]),
        "per_layer": PerLayerArena(per_layer, entry_rows=2),
        "page_major_mha": PageMajorMHAArena(2, 2, 4, 4, torch.float16, 4, 6, "cpu"),
        "page_major_mamba": PageMajorMambaArena(2, [(3, 4)], torch.float16, (2, 2), torch.float32, 6, "cpu"),
        "shard_major": ShardMajorArena([f[3], EntryField("v", 3, (2, 4), torch.float16, tp_axis=0)],
                                       6, "cpu", tp=2, rank=1),
    }
