"""The arena protocol changed no byte: descriptions, fingerprints and segment tables pinned.

The handshake compares descriptions and the transport ships the tables, so a
refactor of how layout dispatches over arena kinds must leave both exactly as
they were. The hashes below were taken from the code BEFORE the protocol
(commit 3497810, the isinstance ladders), one arena per kind
(`arena_kinds.every_kind`); a change to any byte of any kind's description or
of any table planned for `REQUESTS` fails here, naming the kind.
"""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
import torch
from arena_kinds import every_kind
from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayoutError,
    arena_buffers,
    check_indices,
    describe,
    fingerprint,
    plan_segments,
)
from pdxfer.layout.describe import _canonical
from pdxfer.layout.protocol import Arena
from pdxfer.layout.segments import arena_footprints

# Sources within every kind's live range (the strided one's live entries are 2..5).
REQUESTS = [([2, 3, 4], [0, 1, 2]), ([5, 4], [2, 3]), ([3], [5]), ([2, 3, 4, 5], [0, 1, 2, 3]),
            ([4, 5, 2, 3], [3, 2, 1, 0]), ([5, 2, 4], [0, 1, 4])]

# kind -> (fingerprint, sha256 of the whole canonical description, sha256 of every table)
PINNED = {
    'entry_major': (
        'c3c408ee1e208bfb056004d631a702b62f6d8922778d5f77ee2e02ba451b0fcc',
        'bd9a17586b50f4250c2cd9065defc2c1f68ce26853aa36377280b7b04f653dd9',
        '8ff7c25714a507adb9819d7f50c67cee777dd8270b3b59a2dc812492cb29ffa7',
    ),
    'entry_major_strided': (
        '1d42490eaa694aa078f51b8db2f223bff9e311dcb3fb943067cabf1f7315c001',
        'e4210b3eba2247d0a64e1da5ff368638396521676249ed14dc0512dcf01c4020',
        '10441a93b46adb8725144381ce07ca423aed4eec22734aef8c9fe4dde0720a0a',
    ),
    'layer_major': (
        'efbd69fb1eb780cb209c1d877da361433b298504343ce1f0421a2c31baf98e0b',
        '8efe8a037576d92b83504da4b2d7417d2593bd6471eefac3dcd4880641202e9d',
        '62d0041ec3176fb75c5838cd3a2c4ec74e038729dbe050aa43279b942c3b6e61',
    ),
    'split_entry_major': (
        'd9023762d571573af4551be219cf245a7af698f52a005a6bad188d3121aa24c5',
        '3ee9d8ee421a2f36db4f36d872b52d184014220a9c8f41e3eab002c925ee941d',
        '2e04348a0f9f853fe40b6f58f51ee0387297791ddc190994625394b5a16e2302',
    ),
    'per_layer': (
        'da9299f691bdeae04fbd0e99e7ced18667eef2c2cce492969126513d4ffa8376',
        '148353c0ab027efd8062953799da829d99583e6a357cc7da001ef6ea117642b6',
        'f84c3a8330623e670a6a157f4a1ea232503e3f4dffbfb10ff59fd182b940be27',
    ),
    'page_major_mha': (
        'f4118833d51b2cdcf19b32eea475ddcf51417156408df79a8ce6cf94ae866738',
        'f2b8714bcbf4eaeb48f898eefe3c87046a2b3189d01f241d49b6fb445fc2e29b',
        '0dc594302d2b4acecb9d89ca0c57d5a15a424c15a5a0dfd0d372a9b99a519f48',
    ),
    'page_major_mamba': (
        'c0d71f9377ec2da7cc6ce0e27469f4ba1c83c0fcfc05601ccf2016b1d9957a9c',
        '83a791bfe971f2b76046177e6033133651e1fe373509740afc9f0e35995cd3a0',
        '97d4f40e4949862b1e9bbc87f281b68ee4ae3262af23f6373e9013eb8dfa3d6b',
    ),
    'shard_major': (
        'b6ec17149e982057e7942741ffe8b9626f7ea4b926041e6e17485824ea028c1c',
        '792fba56e705ed24b6f593dce94444f555c8f1bb98449ffaad95a594bd0e9e67',
        '2d4eb3141d0b683ce281abafd45fd80437827a0536296f3bd0d8c6a49e73e48e',
    ),
}


def _tables_hash(arena) -> str:
    h = hashlib.sha256()
    for checkpoint in (False, True):
        for src, dst in REQUESTS:
            for table in plan_segments(arena, np.array(src), np.array(dst), checkpoint=checkpoint):
                h.update(np.ascontiguousarray(table, dtype=np.int64).tobytes())
                h.update(b"|")
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_description_and_tables_are_byte_identical_to_before_the_protocol(name: str) -> None:
    arena = every_kind()[name]
    desc = describe(arena)
    fp, whole, tables = PINNED[name]
    assert fingerprint(desc) == fp, f"{name}: the format hash moved, a handshake would refuse"
    assert hashlib.sha256(msgpack.packb(_canonical(desc))).hexdigest() == whole, name
    assert _tables_hash(arena) == tables, f"{name}: a segment table changed"


def test_every_kind_is_pinned() -> None:
    assert sorted(every_kind()) == sorted(PINNED)


class _Reversed:
    """A sixth kind, defined only here: entries stored in reverse index order.

    Nothing in layout names it, so planning, describing and registering it
    working proves no dispatcher asks which kind it holds.
    """

    kind = "test_reversed"

    def __init__(self, fields: list[EntryField], entries: int) -> None:
        self.inner = EntryMajorArena(fields, entries, "cpu")
        self.fields, self.entries, self.live_entries = fields, entries, entries
        self.entry_bytes = self.inner.entry_bytes

    def field_offset(self, name: str) -> int:
        return self.inner.field_offset(name)

    def buffers(self):
        return self.inner.buffers()

    def footprints(self):
        return self.inner.footprints()

    def index_space(self):
        return self.entries, 0

    def strided(self, checkpoint, layers):
        return None  # not strided by index: the vectorised path must ask `plan`

    def plan(self, pair, dst_entries, checkpoint, layers):
        flipped = np.stack([self.entries - 1 - pair[0], dst_entries - 1 - pair[1]])
        order = np.argsort(flipped[0], kind="stable")
        return self.inner.plan(flipped[:, order], dst_entries, checkpoint, layers)

    def description(self):
        desc = self.inner.description()
        desc["kind"] = self.kind
        return desc


def test_a_sixth_kind_plans_and_describes_without_touching_a_dispatcher() -> None:
    fields = [EntryField("x", 2, (4,), torch.float32)]
    arena = _Reversed(fields, 4)
    assert isinstance(arena, Arena)
    table, = plan_segments(arena, [0, 1], [0, 1])
    stride = arena.entry_bytes
    assert table.tolist() == [[2 * stride, 2 * stride, 2 * stride]]
    assert describe(arena)["kind"] == "test_reversed"
    assert fingerprint(describe(arena)) != fingerprint(describe(arena.inner))
    assert arena_buffers(arena)[0] is arena.inner.buf
    assert len(arena_footprints(arena)) == 1
    assert check_indices(arena, [3]).tolist() == [3]


def test_what_is_not_an_arena_is_refused_by_every_entry_point() -> None:
    for call in (lambda: plan_segments("pool", [0], [0]), lambda: describe(object()),
                 lambda: arena_buffers(3)):
        with pytest.raises(LayoutError, match="is not an arena layout knows; it plans any arena kind"):
            call()
