"""Byte arithmetic over cache field declarations: where every byte of an entry lives.

`layout` knows fields, entries and arenas, and nothing of transports or
requests. It answers three questions from one field walk:
- where a field's bytes are (`EntryField`, `field_extents`, the arenas' views);
- which byte ranges ship a set of entries (`plan_segments`, segment tables);
- whether two peers agree on all of that (`describe`, `fingerprint`,
  `describe_diff`).
The page-major builders reproduce SGLang's envelope byte for byte, so a worker
can swap them in and still ship whole pages.
"""

from .arenas import (
    EntryMajorArena,
    LayerMajorArena,
    SplitEntryMajorArena,
    carve_layer_major,
    plan_field_planes,
)
from .describe import FORMAT_VERSION, describe, describe_diff, fingerprint
from .errors import LayoutError, PdxferError
from .fields import (
    EntryField,
    carve,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    plan_regions,
)
from .page_major import (
    PageMajorMambaArena,
    PageMajorMHAArena,
    build_page_major_mamba_views,
    build_page_major_mha_views,
    mamba_entry_bytes,
    mha_entry_bytes,
)
from .per_layer import PerLayerArena
from .segments import arena_buffers, check_indices, coalesce, plan_segments

__all__ = [
    "FORMAT_VERSION",
    "EntryField",
    "EntryMajorArena",
    "LayerMajorArena",
    "LayoutError",
    "PageMajorMHAArena",
    "PageMajorMambaArena",
    "PdxferError",
    "PerLayerArena",
    "SplitEntryMajorArena",
    "arena_buffers",
    "build_page_major_mamba_views",
    "build_page_major_mha_views",
    "carve",
    "carve_layer_major",
    "check_indices",
    "checkpoint_ranges_for",
    "coalesce",
    "describe",
    "describe_diff",
    "entry_bytes_for",
    "field_extents",
    "fingerprint",
    "mamba_entry_bytes",
    "mha_entry_bytes",
    "plan_field_planes",
    "plan_regions",
    "plan_segments",
]
