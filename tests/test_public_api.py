"""The installed packages' public names, pinned: a change to any of them is a decision, made here.

`pdxfer`'s own list is pinned with its engine methods in `tests/pdxfer/test_engine_api.py`;
this pins the two sub-packages a user imports directly (`pdxfer.layout`, `pdxfer.transport`).
"""

from __future__ import annotations

from pdxfer import layout, transport

TRANSPORT = [
    "BoundsError", "Capabilities", "CapabilityError", "CloseError", "ClosedError", "Connection",
    "DeviceRegistrationError", "LocalRegion",
    "NotifyHandler", "PeerLostError", "ProtocolError", "RegistrationError", "TransferHandle",
    "TransferTimeout", "TransportEngine", "TransportError", "available", "capabilities", "create",
    "known", "variants", "why_unavailable",
]
LAYOUT = [
    "ElasticPools", "EntryField", "EntryMajorArena", "FORMAT_VERSION", "IndexMap",
    "LayerInterleavedArena", "LayerMajorArena", "LayoutError", "PageMajorMHAArena", "PageMajorMambaArena", "PdxferError",
    "PerLayerArena", "RankPair", "ResizePlan", "ShardGeometry", "ShardMajorArena",
    "SplitEntryMajorArena", "adopt_ranges", "arena_buffers", "build_page_major_mamba_views",
    "build_page_major_mha_views", "carve", "carve_layer_major", "check_indices",
    "checkpoint_ranges_for", "coalesce", "contributing_ranks", "describe", "describe_diff",
    "describe_diffs",
    "entry_bytes_for", "field_extents", "fingerprint", "is_split_pair", "mamba_entry_bytes",
    "mha_entry_bytes", "pair_pieces", "plan_field_planes", "plan_rank_pair", "plan_regions",
    "plan_resize", "plan_segments", "rank_pair", "relocate", "replica_source", "shard_geometry",
    "split_of",
]


def test_transport_public_names_are_pinned() -> None:
    assert transport.__all__ == TRANSPORT
    assert all(getattr(transport, name) is not None for name in TRANSPORT)


def test_layout_public_names_are_pinned() -> None:
    assert layout.__all__ == LAYOUT
    assert all(getattr(layout, name) is not None for name in LAYOUT)


def test_capabilities_by_name_agree_with_a_default_engine() -> None:
    # One place answers "can its peers be other processes?" without building an engine;
    # it must say what a default-configured engine says.
    for name in transport.available():
        engine = transport.create(name)
        try:
            assert transport.capabilities(name) == engine.capabilities, name
        finally:
            engine.close()
