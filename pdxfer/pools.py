"""An engine's pools: registered once per allocation, described once, planned per request.

Registration is by *allocation*, not by pool. Pools carved out of one buffer
(`layout.carve`, a unified pool whose page/state boundary moves) share bytes,
and registering each pool's buffer would register the same memory twice —
which transports refuse as overlapping, and which is a known failure of
existing PD connectors. So every arena buffer is traced back to the storage it
lives in, each storage is registered once — as a uint8 tensor over the span
its pools cover, so bytes of the allocation that no pool owns are never
exposed to a peer — and a buffer is addressed as `(region, shift)`: its
offset inside that region. The layout planner's offsets count from the buffer, so a request's
table is shifted by the constant `shift` with one vectorised add per column.

Everything per-pool that a request would otherwise recompute (which region,
which shift, which remote descriptor, whether the source needs a
live-entries check) is worked out when a peer's handshake arrives and held in
a `Route`; per request only `plan_segments`, the shift and the post remain.

A pool over an engine's own per-layer tensors (`layout.PerLayerArena`) is
one pool like any other: its 2L tensors are its buffers, each registered
once (or the one allocation they were carved from), described in the one
Hello, and planned by one `plan_segments` call per request. It costs one
transfer per registered allocation its tensors span — a write names one
region pair — so 2L for separately allocated layers, 1 for a carved set.

A pool whose boundary moves (`layout.ElasticPools`, `Engine.resize`) keeps its
buffers, so its registration stays; `PoolSet.replace` swaps in the new arena
and bumps `generation`, and every `Route` re-reads its arena before it plans
again. A Route also holds the peer's live range, from its Hello and then its
`LiveRange` messages, and refuses a destination outside it.

Pool compatibility is decided here too (`mismatch`), once, for both sides: the
fingerprints of the format must agree pool by pool, and the first difference
is reported in `layout.describe_diff`'s words with the pool named. Two
shard-major pools at different TP splits of one format differ in fingerprint
yet are compatible when layout says so; their route plans the rank pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pdxfer import layout
from pdxfer.layout.aliasing import first_alias
from pdxfer.layout.segments import arena_footprints
from pdxfer.transport import streams
from pdxfer.transport.base import LocalRegion, TransportEngine
from pdxfer.transport.errors import ProtocolError, RegistrationError
from pdxfer.transport.segments import CheckedTable

from .errors import LayoutError, LayoutMismatchError, RequestError


def _storage_span(buf: torch.Tensor) -> tuple[str, int, int, Any]:
    storage = buf.untyped_storage()
    start = int(storage.data_ptr())
    return str(buf.device), start, start + int(storage.nbytes()), storage


def _whole(storage: Any, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over every byte of `storage`, to slice the registered span from."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class PoolSet:
    """Every pool of one engine with its registrations and its self-description."""

    def __init__(self, pools: Mapping[str, Any], engine: TransportEngine) -> None:
        if not isinstance(pools, Mapping) or not pools:
            raise RequestError("pools must be a non-empty mapping of name -> arena")
        for name in pools:
            if not isinstance(name, str) or not name:
                raise RequestError(f"pool names must be non-empty str, got {name!r}")
        self.arenas: dict[str, Any] = dict(pools)
        self.descs = {name: layout.describe(a) for name, a in self.arenas.items()}
        self.fingerprints = {name: layout.fingerprint(d) for name, d in self.descs.items()}
        self.entries = {name: int(d["entries"]) for name, d in self.descs.items()}
        # Sources need check_indices only where live_entries narrows the range:
        # plan_segments already refuses negatives and indices past `entries`.
        self.narrowed = {name: int(d["live_entries"]) < int(d["entries"])
                         for name, d in self.descs.items()}
        self.generation = 0  # bumped by `replace`: routes re-read their arena before planning
        # The layers a streamed span must cover (`send(layers=)`, #33): the deepest field of
        # any pool. Pools match by name and format across a handshake, so both sides agree.
        self.depth = max(max((f.layers for f in a.fields), default=1) for a in self.arenas.values())
        self.regions: list[LocalRegion] = []
        self.buffers: dict[str, list[tuple[int, int]]] = {}
        _refuse_aliases(self.arenas)
        self._register(engine)
        self.cuda_regions = [r for r in self.regions if r.device == "cuda"]  # what `readiness` covers

    def _register(self, engine: TransportEngine) -> None:
        bufs = {name: layout.arena_buffers(a) for name, a in self.arenas.items()}
        spans = {}
        for tensors in bufs.values():
            for buf in tensors:
                if not buf.numel():
                    continue  # an empty plane: nothing to address, nothing to register
                device, start, end, storage = _storage_span(buf)
                key = (device, start)
                if key not in spans or spans[key][1] < end:
                    spans[key] = (buf.device, end, storage)
        # Distinct storages with identical bytes (two from_numpy views of one
        # array) collapse by key; a storage inside another is addressed inside
        # the outer one; a partial overlap cannot be registered at all.
        ordered = sorted(spans.items(), key=lambda kv: (kv[0][0], kv[0][1]))
        outer: list[tuple[str, int, int, Any, Any]] = []
        for (device, start), (dev, end, storage) in ordered:
            if outer and outer[-1][0] == device and start < outer[-1][2]:
                if end <= outer[-1][2]:
                    continue
                raise RegistrationError(
                    f"pool storages [{outer[-1][1]:#x}, {outer[-1][2]:#x}) and "
                    f"[{start:#x}, {end:#x}) partially overlap; carve the pools out of one "
                    "allocation instead"
                )
            outer.append((device, start, end, dev, storage))
        # Register the span the pools cover inside each allocation, not the whole
        # storage: bytes of it that no pool owns are never exposed to a peer.
        spans_in = [[None, None] for _ in outer]
        placed: dict[str, list[tuple[int, int]]] = {}
        for name, tensors in bufs.items():
            placed[name] = []
            for buf in tensors:
                if not buf.numel():
                    placed[name].append((-1, 0))
                    continue
                device, ptr = str(buf.device), int(buf.data_ptr())
                i = next(k for k, o in enumerate(outer) if o[0] == device and o[1] <= ptr < o[2])
                lo, hi = spans_in[i]
                spans_in[i] = [ptr if lo is None else min(lo, ptr),
                               ptr + buf.numel() if hi is None else max(hi, ptr + buf.numel())]
                placed[name].append((i, ptr))
        try:
            for (_, start, _, dev, storage), (lo, hi) in zip(outer, spans_in, strict=True):
                whole = _whole(storage, dev)
                self.regions.append(engine.register(whole[lo - start:hi - start]))
        except BaseException:
            for region in self.regions:
                engine.deregister(region)
            raise
        self.buffers = {name: [(i, ptr - spans_in[i][0]) if i >= 0 else (i, 0) for i, ptr in bufs_]
                        for name, bufs_ in placed.items()}

    def replace(self, name: str, arena: Any) -> None:
        """Swap in pool `name`'s arena after its boundary moved (engine lock held).

        Same format and the same buffers, or refused before anything changes:
        the registration is what makes a move free of re-registering, so a
        new buffer would be a different pool.
        """
        desc = layout.describe(arena)
        if layout.fingerprint(desc) != self.fingerprints[name]:
            diff = layout.describe_diff(self.descs[name], desc) or "its format differs"
            raise RequestError(f"pool {name!r}: a resize must keep the pool's format: {diff}")
        spans = [(b.data_ptr(), b.numel()) for b in layout.arena_buffers(arena)]
        if spans != [(b.data_ptr(), b.numel()) for b in layout.arena_buffers(self.arenas[name])]:
            raise RegistrationError(
                f"pool {name!r}: the resized arena lives in other buffers than the registered "
                "ones; a resize moves the boundary inside the allocation, never the allocation"
            )
        self.arenas[name] = arena
        self.descs[name] = desc
        self.entries[name] = int(desc["entries"])
        self.narrowed[name] = int(desc["live_entries"]) < int(desc["entries"])
        self.generation += 1

    def readiness(self, ready: Any) -> dict[LocalRegion, Any]:
        """The event each CUDA region's bytes wait for, captured now on the caller's thread.

        Exists because `send()` may post later, on the progress thread, whose
        current stream is not the caller's: the default (`ready=None`: the
        caller's current stream) must be recorded at send time. Host regions
        get nothing; `ready` for pools that are all host memory is refused
        (`transport.streams.capture`).
        """
        cuda = self.cuda_regions
        if not cuda:
            if ready is not None:  # the common host case costs one comparison
                streams.capture(ready, "cpu")  # raises the clear error
            return {}
        events: dict[torch.device, Any] = {}  # one event per device, shared by its regions
        for r in cuda:  # every backend's regions are `transport.regions.Region`s: .data is the tensor
            if r.data.device not in events:
                events[r.data.device] = streams.capture(ready, r.data.device)
        return {r: events[r.data.device] for r in cuda}

    def hello_fields(self) -> dict[str, Any]:
        """What a Hello (decode) says about these pools: descriptions, buffers, regions."""
        return {
            "pools": self.descs,
            "fingerprints": self.fingerprints,
            "buffers": {n: [list(p) for p in b] for n, b in self.buffers.items()},
            "regions": [r.descriptor() for r in self.regions],
        }


def _refuse_aliases(arenas: Mapping[str, Any]) -> None:
    """`LayoutError` naming two pools (or layers, planes) that share a byte; before registering.

    Sharing an allocation is fine (carved pools, planes interleaved in one
    slot); sharing a byte is not: both would receive it (`layout.aliasing`).
    """
    footprints, labels = [], []
    for name, arena in arenas.items():
        for fp in arena_footprints(arena):
            footprints.append(fp)
            labels.append(f"pool {name!r}" + (f" {fp.label}" if fp.label else ""))
    alias = first_alias(footprints)
    if alias is not None:
        i, j, address = alias
        raise LayoutError(
            f"{labels[j]} shares memory with {labels[i]} (byte {address:#x} is in both): each "
            "would receive the other's requests; give each pool its own memory, or carve one "
            "allocation into disjoint parts (layout.carve)"
        )


def mismatch(prefill: tuple[dict, dict], decode: tuple[dict, dict]) -> str | None:
    """Why a prefill's and a decode's pools cannot exchange bytes, or None if they can.

    Each argument is `(descriptions, fingerprints)` by pool name. Both sides
    call this with the same argument order, so both word a refusal alike.
    """
    p_descs, p_fps = prefill
    d_descs, d_fps = decode
    if set(p_descs) != set(d_descs):
        only_p = sorted(set(p_descs) - set(d_descs))
        only_d = sorted(set(d_descs) - set(p_descs))
        return (f"pool names differ: prefill only {only_p}, decode only {only_d}; "
                "both sides must declare the same pools")
    for name in sorted(p_descs):
        if p_fps.get(name) != d_fps.get(name):
            diff = layout.describe_diff(p_descs[name], d_descs[name])
            if diff is None and layout.is_split_pair(p_descs[name], d_descs[name]):
                continue  # two TP splits of one format: the Route plans the rank pair
            return (f"pool {name!r}: {diff or 'layout fingerprints differ'} "
                    "(prefill vs decode); build both pools from the same declaration")
    return None


def differences(prefill: tuple[dict, dict], decode: tuple[dict, dict]) -> list[str]:
    """Every difference `mismatch` would refuse for, one line each, pool named (empty: they match).

    Where `mismatch` stops at the first (a refusal needs one reason), this
    names them all — a pool only one side declares, then each field and
    attribute of each pool whose format differs — for `pdxfer probe`.
    """
    p_descs, p_fps = prefill
    d_descs, d_fps = decode
    out = [f"pool {name!r}: declared by the {side} only"
           for side, names in (("prefill", sorted(set(p_descs) - set(d_descs))),
                               ("decode", sorted(set(d_descs) - set(p_descs))))
           for name in names]
    for name in sorted(set(p_descs) & set(d_descs)):
        if p_fps.get(name) == d_fps.get(name):
            continue
        diffs = layout.describe_diffs(p_descs[name], d_descs[name])
        if not diffs and layout.is_split_pair(p_descs[name], d_descs[name]):
            continue  # two TP splits of one format: compatible
        out += [f"pool {name!r}: {diff} (prefill vs decode)"
                for diff in diffs or ["layout fingerprints differ"]]
    return out


def layout_error(reason: str) -> LayoutMismatchError:
    return LayoutMismatchError(f"layout mismatch, refused before any write: {reason}")


class Route:
    """One pool of ours to the same pool of one peer: everything a request reuses.

    `groups` holds, per (local region, remote region) pair, the buffer indices
    that pair serves and their shifts — normally one group per pool, so a
    request posts one transfer per pool; planes living in separate
    allocations need one transfer each.
    """

    __slots__ = ("arena", "direct", "dst_entries", "dst_first_live", "gen", "groups", "name",
                 "pair", "per_entry", "pools", "proof", "single")

    def __init__(self, pools: PoolSet, name: str, remote_buffers: Any,
                 remote_regions: list[dict], remote_entries: int,
                 remote_desc: dict | None = None, remote_live: int | None = None) -> None:
        local = pools.buffers[name]
        if not isinstance(remote_buffers, list) or len(remote_buffers) != len(local):
            raise ProtocolError(
                f"pool {name!r}: peer describes {remote_buffers!r} buffers, we have {len(local)}"
            )
        self.pools, self.name, self.gen = pools, name, pools.generation
        self.arena = pools.arenas[name]
        self.dst_entries = remote_entries
        # The peer's live entries start here (they count from the end, `layout.describe`).
        self.dst_first_live = remote_entries - (remote_entries if remote_live is None else remote_live)
        # A peer at another TP split of the same format: layout plans the pair.
        try:
            self.pair = layout.rank_pair(self.arena, remote_desc)
        except layout.LayoutError as exc:
            raise ProtocolError(f"pool {name!r}: {exc}") from exc
        grouped: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for b, ((lr, ls), rb) in enumerate(zip(local, remote_buffers, strict=True)):
            ok = (isinstance(rb, list) and len(rb) == 2 and all(type(v) is int for v in rb)
                  and (0 <= rb[0] < len(remote_regions) and rb[1] >= 0 and lr >= 0
                       or rb == [-1, 0] and lr == -1))
            if not ok:
                raise ProtocolError(f"pool {name!r}: malformed remote buffer entry {rb!r}")
            if lr >= 0:  # an empty buffer plans empty tables: it needs no route
                grouped.setdefault((lr, rb[0]), []).append((b, ls, rb[1]))
        self.groups = [
            (pools.regions[lr], remote_regions[rr], [m[0] for m in members],
             [m[1] for m in members], [m[2] for m in members])
            for (lr, rr), members in grouped.items()
        ]
        # The common case, kept branch-free per request: one buffer, one pair.
        self.single = None
        if len(local) == 1 and self.groups:
            g = self.groups[0]
            self.single = (g[0], g[1], g[3][0], g[4][0])
        self._prove()
        # Per-layer tensors in allocations of their own: each buffer is a
        # region at shift 0 on both sides, so its table posts as planned.
        self.direct = None
        if len(self.groups) > 1 and all(len(g[2]) == 1 and not g[3][0] and not g[4][0]
                                        for g in self.groups):
            self.direct = [(g[0], g[1], g[2][0]) for g in self.groups]

    def _prove(self) -> None:
        self.proof = self._proof()
        # Bytes one entry ships (whole, checkpoint): a proven table's total without a sum.
        self.per_entry = ((self.arena.entry_bytes, sum(n for _, n in self.arena.checkpoint_ranges))
                          if self.proof is not None else (0, 0))

    def set_peer_range(self, entries: int, live: int) -> None:
        """The peer moved its pool's boundary (`LiveRange`; engine lock held): plan against it."""
        self.dst_entries, self.dst_first_live = entries, entries - live
        self._prove()

    def _refresh(self) -> None:
        """Our own pool's boundary moved (`PoolSet.replace`): take the new arena, prove again."""
        self.arena, self.gen = self.pools.arenas[self.name], self.pools.generation
        self._prove()

    def check_destinations(self, dst: np.ndarray) -> None:
        """Refuse destinations below the peer's live range, naming it (entries above are
        `plan_segments`' to refuse, against `dst_entries`)."""
        if dst.size and int(dst.min()) < self.dst_first_live:
            pos = int(np.flatnonzero(dst < self.dst_first_live)[0])
            raise LayoutError(
                f"pool {self.name!r} destination index {int(dst[pos])} at position {pos} is "
                f"outside the decode's live entries {self.dst_first_live}..{self.dst_entries - 1} "
                "(as it last announced them); the decode must name live entries"
            )

    def _proof(self) -> tuple[int, int] | None:
        """`(local, remote region length)` when every planned table provably fits both; else None.

        Whole-slot arenas, one buffer, one region pair: `plan_segments` admits
        sources `< entries` and distinct destinations `< dst_entries`, and
        each row stays inside its entry's slot, so a row lies within
        `shift + entries * slot_stride` on its side and destinations never
        overlap. That bound is checked here once, against our region and the
        peer's descriptor; a peer whose entry count its region cannot hold
        gets no proof, and its tables are refused by the transport's full
        check as before.
        """
        a = self.arena
        if (self.single is None or self.pair is not None or not isinstance(a, layout.EntryMajorArena)
                or a.entry_bytes > a.slot_stride
                or any(o < 0 or o + n > a.entry_bytes for o, n in a.checkpoint_ranges)):
            return None
        region, remote, ls, rs = self.single
        theirs = remote.get("length") if isinstance(remote, dict) else None
        if (type(theirs) is not int or ls + a.entries * a.slot_stride > region.length
                or rs + self.dst_entries * a.slot_stride > theirs):
            return None
        return region.length, theirs

    def plan(self, src: np.ndarray, dst: np.ndarray, checkpoint: bool,
             layers: tuple[int, int] | None = None) -> list[tuple[LocalRegion, dict, np.ndarray]]:
        """`(local region, remote descriptor, table)` per transfer, empty tables dropped.

        `layers=(a, b)`: only those layers of the entries (`send(layers=)`);
        the pool's own layer axis, so a pool shallower than the engine's
        deepest ships the layers it has in the range (nothing past them).
        """
        if self.gen != self.pools.generation:
            self._refresh()
        if self.dst_first_live:
            self.check_destinations(dst)
        if layers is not None:
            layers = pool_layers(self.name, self.arena, layers)
            if layers is None:
                return []
            if self.pair is not None:
                raise RequestError(
                    f"pool {self.name!r}: a layer range to a peer at another TP split is not "
                    "planned (its rank pair ships whole entries); send whole entries to it")
        if self.pair is not None:
            tables = self.pair.plan(src, dst, dst_entries=self.dst_entries, checkpoint=checkpoint)
        else:
            tables = layout.plan_segments(self.arena, src, dst, checkpoint=checkpoint,
                                          dst_entries=self.dst_entries, layers=layers)
        if self.single is not None:
            region, remote, ls, rs = self.single
            table = tables[0]
            if not table.shape[0]:
                return []
            if ls:
                table[:, 0] += ls
            if rs:
                table[:, 1] += rs
            if self.proof is not None:
                table = CheckedTable.proven(table, len(src) * self.per_entry[checkpoint], *self.proof)
            return [(region, remote, table)]
        if self.direct is not None:
            return [(region, remote, tables[b]) for region, remote, b in self.direct
                    if tables[b].shape[0]]
        out = []
        for region, remote, members, lshifts, rshifts in self.groups:
            parts = []
            for b, ls, rs in zip(members, lshifts, rshifts, strict=True):
                table = tables[b]
                if table.shape[0]:
                    if ls:
                        table[:, 0] += ls
                    if rs:
                        table[:, 1] += rs
                    parts.append(table)
            if parts:
                out.append((region, remote, parts[0] if len(parts) == 1 else np.concatenate(parts)))
        return out


def pool_layers(name: str, arena: Any, layers: tuple[int, int]) -> tuple[int, int] | None:
    """The part of an engine-wide layer range `(a, b)` pool `name` has, None if none of it.

    A pool's layer `l` is its own fields' layer `l`; one shallower than the
    engine's deepest pool ships its layers inside the range. An arena that
    cannot ship a layer range (page-major pools declare each layer as a field)
    is refused here, by `plan_segments`, before anything is planned.
    """
    depth = max((f.layers for f in arena.fields), default=1)
    a, b = layers
    if a >= depth:
        return None
    clipped = (a, min(b, depth))
    try:
        layout.plan_segments(arena, np.empty(0, np.int64), np.empty(0, np.int64), layers=clipped)
    except LayoutError as exc:
        raise LayoutError(f"pool {name!r} cannot ship layers {clipped}: {exc}") from exc
    return clipped


def peer_routes(pools: PoolSet, peer_pools: Any, peer_buffers: Any,
                peer_regions: Any) -> dict[str, Route]:
    """A `Route` per pool from a peer's Hello (already found compatible), or `ProtocolError`."""
    if not isinstance(peer_buffers, dict) or not isinstance(peer_regions, list):
        raise ProtocolError("peer buffers must be a dict and regions a list")
    routes = {}
    for name in pools.arenas:
        entries, live = peer_range(name, peer_pools[name].get("entries"),
                                   peer_pools[name].get("live_entries"))
        routes[name] = Route(pools, name, peer_buffers.get(name), peer_regions, entries,
                             peer_pools[name], live)
    return routes


def peer_range(name: str, entries: Any, live: Any) -> tuple[int, int]:
    """A peer's `(entries, live_entries)` for pool `name`, or `ProtocolError` saying what is off."""
    if type(entries) is not int or entries < 0:
        raise ProtocolError(f"pool {name!r}: the peer's entry count is {entries!r}")
    if type(live) is not int or not 0 <= live <= entries:
        raise ProtocolError(f"pool {name!r}: the peer's live entries are {live!r} of {entries}")
    return entries, live
