"""The engine benches' workload: the pools a request moves between and the requests.

`bench engine`, `bench request-cost`, `bench chunked` and the decode side
they drive in a child process (`decode_peer`) all move requests of 16 KV
pages of a small model plus one recurrent-state entry; the fields, the pool
sizes and how requests are drawn are stated here once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdxfer import layout

__all__ = ["ENTRIES", "KINDS", "KV_FIELDS", "PAGES", "STATE_FIELDS", "TINY_ENTRIES", "describe",
           "pools", "requests"]

PAGES = 16
# A small model's page: 8 layers x 16 tokens x 2 heads x 64 dims fp16, K and V (64 KiB).
KV_FIELDS = [
    layout.EntryField("k", 8, (16, 2, 64), torch.float16),
    layout.EntryField("v", 8, (16, 2, 64), torch.float16),
]
# A hybrid layer's recurrent state: conv window and SSM state per layer (~40 KiB).
STATE_FIELDS = [
    layout.EntryField("conv", 8, (3, 128), torch.bfloat16),
    layout.EntryField("ssm", 8, (8, 128), torch.float32),
]


KINDS = ("entry-major", "layer-major", "per-layer tensors")
# Pool sizes (KV pages, state entries) of the engine benches: requests scatter
# over 4096 pages as a paged allocator's would. `--tiny` takes 64: the pools
# are zeroed at start, and 4096 64-KiB pages is 256 MiB per pool.
ENTRIES, TINY_ENTRIES = (4096, 256), (64, 16)


def pools(kind: str, kv_entries: int, state_entries: int) -> dict[str, Any]:
    """`{"kv": ..., "state": ...}` of `kind` (one of `KINDS`), zeroed, on the CPU."""
    if kind == "per-layer tensors":  # as SGLang allocates: one tensor per layer and field
        kv: Any = layout.PerLayerArena({f.name: [torch.zeros(kv_entries, *f.shape, dtype=f.dtype)
                                                 for _ in range(f.layers)] for f in KV_FIELDS})
    else:
        kv_cls = layout.EntryMajorArena if kind == "entry-major" else layout.LayerMajorArena
        kv = kv_cls(KV_FIELDS, kv_entries, "cpu")
    return {"kv": kv, "state": layout.EntryMajorArena(STATE_FIELDS, state_entries, "cpu")}


def requests(n: int, kv_entries: int, state_entries: int, seed: int) -> list[tuple[dict, dict]]:
    """`n` (source, destination) index pairs: `PAGES` scattered pages + one state entry each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = {"kv": rng.choice(kv_entries, PAGES, replace=False), "state": np.array([i % state_entries])}
        dst = {"kv": rng.choice(kv_entries, PAGES, replace=False), "state": np.array([i % state_entries])}
        out.append((src, dst))
    return out


def describe() -> str:
    """What one request moves, in words, for a bench's header line."""
    return (f"{PAGES} KV pages ({layout.entry_bytes_for(KV_FIELDS) // 1024} KiB each) + 1 state "
            f"entry ({layout.entry_bytes_for(STATE_FIELDS) // 1024} KiB)")
