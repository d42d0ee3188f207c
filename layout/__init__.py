"""Byte arithmetic over cache field declarations: where every byte of an entry lives.

`layout` knows fields, entries and arenas, and nothing of transports or
requests. It answers these questions from one field walk:
- where a field's bytes are (`EntryField`, `field_extents`, the arenas' views);
- which byte ranges ship a set of entries, or a layer range of them
  (`plan_segments`, segment tables; `LayerInterleavedArena` makes a layer
  range one range per entry);
- what every arena kind answers so no planner asks which kind it is
  (`layout.protocol.Arena`);
- whether two peers agree on all of that (`describe`, `fingerprint`,
  `describe_diff`, `describe_diffs`);
- for a page pool and a state pool sharing one allocation, which entries
  move when their boundary does (`ElasticPools`, `plan_resize`, `relocate`);
- for tensor parallelism, which part of an entry a rank holds
  (`ShardMajorArena`) and which bytes a prefill rank ships to a decode rank
  of another TP size (`rank_pair`, `contributing_ranks`).
The page-major builders reproduce SGLang's envelope byte for byte, so a worker
can swap them in and still ship whole pages.
"""

from .arenas import EntryMajorArena, SplitEntryMajorArena, plan_field_planes
from .describe import (
    FORMAT_VERSION,
    describe,
    describe_diff,
    describe_diffs,
    fingerprint,
    is_split_pair,
    split_of,
)
from .elastic import ElasticPools, IndexMap, ResizePlan, plan_resize, relocate
from .errors import LayoutError, PdxferError
from .fields import (
    EntryField,
    carve,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    plan_regions,
)
from .interleaved import LayerInterleavedArena
from .layer_major import LayerMajorArena, carve_layer_major
from .page_major import (
    PageMajorMambaArena,
    PageMajorMHAArena,
    build_page_major_mamba_views,
    build_page_major_mha_views,
    mamba_entry_bytes,
    mha_entry_bytes,
)
from .per_layer import PerLayerArena
from .ranges import adopt_ranges
from .segments import arena_buffers, check_indices, coalesce, plan_segments
from .shards import ShardGeometry, ShardMajorArena, shard_geometry
from .tp_plan import (
    RankPair,
    contributing_ranks,
    pair_pieces,
    plan_rank_pair,
    rank_pair,
    replica_source,
)

__all__ = [
    "ElasticPools",
    "EntryField",
    "EntryMajorArena",
    "FORMAT_VERSION",
    "IndexMap",
    "LayerInterleavedArena",
    "LayerMajorArena",
    "LayoutError",
    "PageMajorMHAArena",
    "PageMajorMambaArena",
    "PdxferError",
    "PerLayerArena",
    "RankPair",
    "ResizePlan",
    "ShardGeometry",
    "ShardMajorArena",
    "SplitEntryMajorArena",
    "adopt_ranges",
    "arena_buffers",
    "build_page_major_mamba_views",
    "build_page_major_mha_views",
    "carve",
    "carve_layer_major",
    "check_indices",
    "checkpoint_ranges_for",
    "coalesce",
    "contributing_ranks",
    "describe",
    "describe_diff",
    "describe_diffs",
    "entry_bytes_for",
    "field_extents",
    "fingerprint",
    "is_split_pair",
    "mamba_entry_bytes",
    "mha_entry_bytes",
    "pair_pieces",
    "plan_field_planes",
    "plan_rank_pair",
    "plan_regions",
    "plan_resize",
    "plan_segments",
    "rank_pair",
    "relocate",
    "replica_source",
    "shard_geometry",
    "split_of",
]
