"""Pool declarations for `pdxfer probe --layout` in the tests: the prefill process's, and others.

`prefill_proc.py` builds `build_pools(entries, 16, kind, kv_fields=BIG_KV_FIELDS)`; `matching`
declares the same format with fewer entries (entry counts are not compared), the others
differ from it in ways the probe must name.
"""

from __future__ import annotations

import torch
from pdxfer_testkit import BIG_KV_FIELDS, STATE_FIELDS, build_pools

from pdxfer import layout


def matching() -> dict:
    return build_pools(8, 4, kv_fields=BIG_KV_FIELDS)


def mismatched() -> dict:
    """kv: v in bfloat16 and k with 8 layers; state: ring's fill; and an extra pool."""
    kv = [layout.EntryField("k", 8, (16, 128), torch.float16),
          layout.EntryField("v", 4, (16, 128), torch.bfloat16)]
    state = [f if f.name != "ring" else layout.EntryField("ring", 2, (8,), torch.float32,
                                                           in_checkpoint=False, fill=-1.0)
             for f in STATE_FIELDS]
    return {"kv": layout.EntryMajorArena(kv, 8, "cpu"),
            "state": layout.EntryMajorArena(state, 4, "cpu"),
            "aux": layout.EntryMajorArena([layout.EntryField("tok", 1, (1,), torch.int64)], 4, "cpu")}
