"""The toy model's caches: three pdxfer arenas and the entries handed out of them.

The model keeps no cache tensors of its own. Everything a request leaves behind
lives in one of three pools, and the model reads and writes it only through
the arenas' per-layer views (`arena.view(name)` -> `[layers, entries, *shape]`):

- ``kv``: paged MHA attention. One entry is one *page* of `page_size` tokens
  holding that page's K and V (float8_e4m3fn) and their float32 per-page scales
  for every attention layer, so a page is one contiguous byte range carrying
  its own scales and a run of pages is one segment on the wire.
- ``state``: one entry per request, holding everything recurrent: the GDN-style
  conv window and temporal state, and the DeepSeek-V4-style compressor's
  `kv_state`/`score_state` ring, whose score plane starts at `-inf` so a ring
  slot nobody wrote loses the softmax. One request's whole state is one range.
- ``aux``: one entry per request carrying the first output token, so prefill
  hands decode its sampled token through the same transfer as the caches.

The field lists are declared once, here (`pool_fields`); the worker arenas, the
single-process reference and the layer-major baseline the launcher compares
against all read them, so the three cannot describe different bytes.

Entries are handed out by `EntryAllocator`, a plain free list. It exists so
both the workers and the reference allocate the same *number* of entries per
request (the model's batch shapes follow from that, and bit-for-bit equality
with the reference depends on identical shapes), not to be a good allocator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from pdxfer.layout import (
    ElasticPools,
    EntryField,
    EntryMajorArena,
    IndexMap,
    LayerInterleavedArena,
    LayerMajorArena,
    SplitEntryMajorArena,
    plan_segments,
)

from .model import FP8, ModelConfig

POOLS = ("kv", "state", "aux")


def pool_fields(cfg: ModelConfig) -> dict[str, list[EntryField]]:
    """Every pool's field declaration — the one place the cache format is stated."""
    f32 = torch.float32
    page = (cfg.page_size, cfg.heads, cfg.head_dim)
    return {
        # FP8 K/V, and each page's float32 scales (one per layer and KV head, the
        # rule is `model.write_fp8`'s) as fields of the same entry: a page ships
        # its scales in its own byte range, layer by layer when interleaved.
        "kv": [
            EntryField("k", cfg.attn_layers, page, FP8),
            EntryField("v", cfg.attn_layers, page, FP8),
            # (K, V) x heads in one field: every field starts on a 256-byte
            # boundary, so two scale fields would pad twice per layer and page.
            EntryField("kv_scale", cfg.attn_layers, (2, cfg.heads), f32, fill=1.0),
        ],
        "state": [
            EntryField("conv", 1, (cfg.conv_width - 1, cfg.dim), f32),
            EntryField("temporal", 1, (cfg.rec_heads, cfg.rec_dk, cfg.rec_dv), f32),
            EntryField("kv_state", 1, (cfg.ring, cfg.comp_dim), f32),
            # -inf: an unwritten ring slot must lose the softmax, not tie at 0.
            EntryField("score_state", 1, (cfg.ring, cfg.comp_dim), f32, fill=float("-inf")),
        ],
        "aux": [EntryField("first_token", 1, (1,), torch.int64)],
    }


def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding `tokens` positions."""
    return math.ceil(tokens / page_size)


def prefill_counts(cfg: ModelConfig, prompt_len: int) -> dict[str, int]:
    """Entries per pool a prefill writes and ships for a prompt of `prompt_len`."""
    return {"kv": pages_for(prompt_len, cfg.page_size), "state": 1, "aux": 1}


def decode_counts(cfg: ModelConfig, prompt_len: int, gen_len: int) -> dict[str, int]:
    """Entries per pool decode holds: the prompt's pages plus room for generated tokens.

    The last generated token is never fed back, so `gen_len - 1` positions are
    written after the prompt.
    """
    pages = pages_for(prompt_len + gen_len - 1, cfg.page_size)
    return {"kv": pages, "state": 1, "aux": 1}


class PoolExhausted(RuntimeError):
    """Not enough free entries for a request; the message says how to size the pool."""


class EntryAllocator:
    """A free list of entry indices, lowest first."""

    def __init__(self, name: str, entries: int, flag: str) -> None:
        self.name = name
        self.entries = entries
        self._flag = flag
        # Kept descending so pop() hands out the lowest index: adjacent
        # requests then get adjacent runs, which is what real pools mostly do.
        self._free = list(range(entries - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> np.ndarray:
        """`count` entries, or `PoolExhausted` before taking any."""
        if count > len(self._free):
            raise PoolExhausted(
                f"pool {self.name!r} has {len(self._free)} of {self.entries} entries free, "
                f"a request needs {count}; start the worker with a larger {self._flag}"
            )
        return np.array([self._free.pop() for _ in range(count)], dtype=np.int64)

    def give_back(self, indices: np.ndarray) -> None:
        """Return entries; a double free is a bug in the caller and refused."""
        back = [int(i) for i in indices]
        if set(back) & set(self._free):
            raise RuntimeError(f"pool {self.name!r}: entries {back} freed twice")
        self._free.extend(back)
        self._free.sort(reverse=True)


# The pools of `POOLS` that share one allocation when elastic (the page pool first).
SHARED = ("kv", "state")


class PoolSide:
    """One pool's view of a `SlotAllocator`: what `caches.EntryAllocator` offers, over the slots."""

    def __init__(self, slots: SlotAllocator, name: str, flag: str) -> None:
        self.slots, self.name, self._flag = slots, name, flag

    @property
    def entries(self) -> int:
        lo, hi = self.slots.live(self.name)
        return hi - lo

    @property
    def free(self) -> int:
        lo, hi = self.slots.live(self.name)
        return int(np.count_nonzero(~self.slots.used[lo:hi]))

    def take(self, count: int) -> np.ndarray:
        lo, hi = self.slots.live(self.name)
        free = np.flatnonzero(~self.slots.used[lo:hi]) + lo
        if count > free.size:
            raise PoolExhausted(
                f"pool {self.name!r} has {free.size} of {hi - lo} entries free, a request needs "
                f"{count}; start the worker with a larger {self._flag}"
            )
        # Nearest the boundary first: the top pages, the bottom states (see `SlotAllocator`).
        got = free[free.size - count:] if self.name == SHARED[0] else free[:count]
        self.slots.used[got] = True
        return got.astype(np.int64)

    def give_back(self, indices: np.ndarray) -> None:
        idx = np.asarray(indices, dtype=np.int64)
        if not self.slots.used[idx].all():
            raise RuntimeError(f"pool {self.name!r}: entries {idx.tolist()} freed twice")
        self.slots.used[idx] = False


class SlotAllocator:
    """Which slots of an `ElasticPools` hold a live entry, for both of its pools.

    Hands out the free entry NEAREST the boundary first (pages from the top
    of their range down, states from the bottom up). That is the worst case
    for a resize, chosen on purpose for the demo (`examples.elastic`): the
    request in flight then sits where the next move vacates, so every move
    relocates live entries. A production allocator would hand out entries
    far from the boundary and move almost nothing.
    """

    def __init__(self, pools: ElasticPools) -> None:
        self.pools = pools
        self.used = np.zeros(pools.slots, dtype=bool)

    def live(self, name: str) -> tuple[int, int]:
        b = self.pools.boundary
        return (0, b) if name == SHARED[0] else (b, self.pools.slots)

    def in_use(self, name: str) -> np.ndarray:
        lo, hi = self.live(name)
        return np.flatnonzero(self.used[lo:hi]) + lo

    def moved(self, moves: IndexMap) -> None:
        """The boundary moved: the relocated entries' slots change hands."""
        self.used[moves.old] = False
        self.used[moves.new] = True


@dataclass(frozen=True)
class PoolSizes:
    """How many entries each pool of a worker holds."""

    kv_pages: int = 256
    state_entries: int = 16

    def entries(self) -> dict[str, int]:
        return {"kv": self.kv_pages, "state": self.state_entries, "aux": self.state_entries}


_FLAGS = {"kv": "--kv-pages", "state": "--state-entries", "aux": "--state-entries"}


class ModelCaches:
    """The three arenas of one worker (or of the reference run) and their allocators.

    `elastic=True` carves `kv` and `state` out of one `layout.ElasticPools`
    (`kv_pages + state_entries` slots, the boundary after the pages) whose
    boundary a worker moves (`examples.elastic`); `aux` stays on its own.
    `interleaved=True` orders each kv page layer first (`LayerInterleavedArena`:
    `[layer 0: k v kv_scale][layer 1: ...]`), so a prefill streaming layer groups
    (`--layer-groups`) ships one range per page per group; the model reads it
    through the same views, so its arithmetic is the same.
    """

    def __init__(self, cfg: ModelConfig, sizes: PoolSizes, device: torch.device,
                 elastic: bool = False, interleaved: bool = False) -> None:
        fields = pool_fields(cfg)
        counts = sizes.entries()
        self.cfg = cfg
        kinds = {"kv": LayerInterleavedArena} if interleaved else {}
        self.pools: dict[str, EntryMajorArena | SplitEntryMajorArena] = {
            name: kinds.get(name, EntryMajorArena)(fields[name], counts[name], device)
            for name in POOLS if not elastic or name not in SHARED
        }
        self.allocators: dict[str, EntryAllocator | PoolSide] = {
            name: EntryAllocator(name, counts[name], _FLAGS[name])
            for name in POOLS if not elastic or name not in SHARED
        }
        self.elastic: ElasticPools | None = None
        if elastic:
            self.elastic = ElasticPools(fields["kv"], fields["state"],
                                        sizes.kv_pages + sizes.state_entries, sizes.kv_pages,
                                        device)
            self.slots = SlotAllocator(self.elastic)
            self.allocators.update({name: PoolSide(self.slots, name, _FLAGS[name])
                                    for name in SHARED})
            self._refresh()

    def _refresh(self) -> None:
        assert self.elastic is not None
        self.pools.update(zip(SHARED, (self.elastic.page, self.elastic.state), strict=True))

    def moved(self, moves: IndexMap) -> None:
        """The elastic boundary moved: take the new arenas, hand the moved slots over."""
        self._refresh()
        self.slots.moved(moves)

    def index_space(self, name: str) -> int:
        """How many indices pool `name` may ever name: its entries, or all the slots it shares."""
        if self.elastic is not None and name in SHARED:
            return self.elastic.slots
        return self.pools[name].entries

    def allocate(self, counts: dict[str, int]) -> dict[str, np.ndarray]:
        """Entries for one request from every pool, all or nothing."""
        short = [n for n in POOLS if counts[n] > self.allocators[n].free]
        if short:
            self.allocators[short[0]].take(counts[short[0]])  # raises with the sizing hint
        return {name: self.allocators[name].take(counts[name]) for name in POOLS}

    def free(self, indices: dict[str, np.ndarray]) -> None:
        for name, idx in indices.items():
            self.allocators[name].give_back(idx)

    def reset_state(self, entry: int) -> None:
        """Put a reused state entry back to every field's declared fill.

        A fresh request starts from the fill values the declaration states
        (zero conv window, zero temporal state, `-inf` scores), whatever the
        entry's previous owner left there.
        """
        self.reset_fields(entry, [f.name for f in self.pools["state"].fields])

    def reset_fields(self, entry: int, names: Iterable[str]) -> None:
        """Fill the named fields of one state entry with their declared fills."""
        arena = self.pools["state"]
        by_name = {f.name: f for f in arena.fields}
        for name in names:
            arena.view(name)[:, entry].fill_(by_name[name].fill)


class LayerMajorBaseline:
    """How many segments a layer-major pool with the same fields would post.

    The launcher prints this next to the entry-major count, so it is computed
    by the same planner (`layout.plan_segments`) over a `LayerMajorArena`
    declared from the very same field lists, never estimated. The twins are
    planning-only: their bytes are allocated (the arena insists) but never
    read or shipped, and they live on the CPU whatever the model's device.
    """

    def __init__(self, caches: ModelCaches) -> None:
        self._twins = {
            name: LayerMajorArena(arena.fields, caches.index_space(name), "cpu")
            for name, arena in caches.pools.items()
        }

    def segments(
        self, src: dict[str, np.ndarray], dst: dict[str, np.ndarray], dst_entries: dict[str, int],
    ) -> int:
        """Segments (rows over all buffer tables) for shipping `src` -> `dst`."""
        return sum(
            len(table)
            for name, twin in self._twins.items()
            for table in plan_segments(twin, src[name], dst[name], dst_entries=dst_entries[name])
        )
