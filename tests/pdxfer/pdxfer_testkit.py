"""Pools, fillers and byte checks shared by the engine tests and the prefill helper process.

A module rather than fixtures because `prefill_proc.py` (a separate process)
must build exactly the same pools from the same seed as the test that drives
it. Every pool is filled through its field views only, so alignment padding
stays zero on both sides and `expected_after` can predict the receiver's
whole buffer byte for byte: a stray write anywhere — outside the named
entries or inside their padding — breaks the equality.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from pdxfer import EngineConfig, layout, transport

# Every backend present: each engine test runs over all of them (the conftest fixtures).
BACKENDS = transport.available()


CROSS_PROCESS = [b for b in BACKENDS if transport.capabilities(b).cross_process]


def config(backend: str, **kw) -> EngineConfig:
    """Short timeouts: faults must show up in well under the test budget."""
    opts = {"timeout": 2.0, "abort_grace": 0.3}
    opts.update(kw)
    return EngineConfig(transport=backend, **opts)



KV_FIELDS = [
    layout.EntryField("k", 2, (2, 16), torch.float16),
    layout.EntryField("v", 2, (2, 16), torch.float16),
    layout.EntryField("k_scale", 2, (2,), torch.float32),
]
# 32 KiB pages: a request of 64 pages takes long enough on the wire to be cut mid-send.
BIG_KV_FIELDS = [
    layout.EntryField("k", 4, (16, 128), torch.float16),
    layout.EntryField("v", 4, (16, 128), torch.float16),
]
STATE_FIELDS = [
    layout.EntryField("conv", 2, (3, 16), torch.bfloat16),
    layout.EntryField("ssm", 2, (4, 8), torch.float32),
    # A ring a checkpoint does not carry: checkpoint sends must leave it alone.
    layout.EntryField("ring", 2, (8,), torch.float32, in_checkpoint=False),
]


def build_pools(kv_entries: int = 256, state_entries: int = 64, *, kind: str = "entry",
                seed: int | None = None, kv_fields: list | None = None) -> dict:
    """`{"kv": ..., "state": ...}`; `kind` is "entry", "layer" or "interleaved" (the kv pool's order)."""
    fields = kv_fields or KV_FIELDS
    if kind == "entry":
        kv = layout.EntryMajorArena(fields, kv_entries, "cpu")
    elif kind == "interleaved":
        kv = layout.LayerInterleavedArena(fields, kv_entries, "cpu")
    elif kind == "layer":
        kv = layout.LayerMajorArena(fields, kv_entries, "cpu")
    else:
        raise ValueError(kind)
    pools = {"kv": kv, "state": layout.EntryMajorArena(STATE_FIELDS, state_entries, "cpu")}
    if seed is not None:
        fill(pools, seed)
    return pools


def fill(pools: dict, seed: int) -> None:
    """Random bytes in every field of every pool (never in padding)."""
    gen = torch.Generator().manual_seed(seed)
    for arena in pools.values():
        for field in arena.fields:
            raw = arena.view(field.name).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def snapshot(pools: dict) -> dict:
    """A copy of every buffer of every pool."""
    return {name: [b.clone() for b in layout.arena_buffers(a)] for name, a in pools.items()}


def expected_after(dst_pools: dict, before: dict, src_pools: dict,
                   moves: list[tuple[str, np.ndarray, np.ndarray]],
                   checkpoint: bool = False) -> dict:
    """What the receiver's buffers must hold after `moves` = [(pool, src, dst)] landed.

    Built field by field through the views of a scratch arena over a copy of
    `before`, so it shares no arithmetic with the planner it checks.
    """
    out = {}
    for name, arena in dst_pools.items():
        bufs = [torch.empty_like(b) for b in before[name]]
        scratch = _rebuild(arena, bufs)
        for b, old in zip(bufs, before[name], strict=True):  # after: building may fill
            b.copy_(old)
        for pool, src, dst in moves:
            if pool != name:
                continue
            for field in arena.fields:
                if checkpoint and not field.in_checkpoint:
                    continue
                s = torch.as_tensor(np.asarray(src, dtype=np.int64))
                d = torch.as_tensor(np.asarray(dst, dtype=np.int64))
                scratch.view(field.name)[:, d] = src_pools[pool].view(field.name)[:, s]
        out[name] = bufs
    return out


def _rebuild(arena, bufs: list[torch.Tensor]):
    if isinstance(arena, layout.LayerMajorArena):
        return layout.LayerMajorArena(arena.fields, arena.entries, "cpu", buf=bufs[0])
    if isinstance(arena, layout.LayerInterleavedArena):
        return layout.LayerInterleavedArena(arena.fields, arena.entries, "cpu", buf=bufs[0],
                                            slot_stride=arena.slot_stride)
    if isinstance(arena, layout.SplitEntryMajorArena):
        return layout.SplitEntryMajorArena([_rebuild(p, [b]) for p, b in zip(arena.arenas, bufs, strict=True)])
    return layout.EntryMajorArena(arena.fields, arena.entries, "cpu", buf=bufs[0],
                                  slot_stride=arena.slot_stride, live_entries=arena.entries)


def assert_buffers(pools: dict, expected: dict) -> None:
    """Every byte of every pool equals the prediction; names the first differing byte."""
    for name, arena in pools.items():
        for i, (got, want) in enumerate(zip(layout.arena_buffers(arena), expected[name], strict=True)):
            if not torch.equal(got, want):
                bad = torch.nonzero(got != want)[:1].flatten().tolist()
                raise AssertionError(
                    f"pool {name!r} buffer {i}: {int((got != want).sum())} bytes differ, first at "
                    f"byte {bad[0]} (entry {bad[0] // max(1, getattr(arena, 'slot_stride', 1) or 1)})"
                )


def entries_crc(pools: dict, pool: str, idx) -> int:
    """crc32 of every field byte of entries `idx` (in that order) of one pool."""
    arena = pools[pool]
    sel = torch.as_tensor(np.asarray(idx, dtype=np.int64))
    crc = 0
    for field in arena.fields:
        data = arena.view(field.name)[:, sel].transpose(0, 1).contiguous().view(torch.uint8)
        crc = zlib.crc32(data.numpy().tobytes(), crc)
    return crc


def runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Contiguous runs in a request: pairs consecutive on both sides, after sorting by source."""
    order = np.argsort(src, kind="stable")
    s, d = np.asarray(src)[order], np.asarray(dst)[order]
    if s.size == 0:
        return 0
    return 1 + int(np.count_nonzero(~((s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1))))


def until(predicate, what: str, limit: float = 20.0) -> None:
    """Wait for a state change another thread makes, polling it (not a timed sleep).

    The limit is a safety net for a broken engine, far above any contract
    bound, so CPU load cannot make it fire on a working one.
    """
    import time

    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {limit} s: {what}")
        time.sleep(0.001)


def poll_or_none(engine, rid: str):
    """`engine.poll(rid)`, or None while the engine does not know the id yet."""
    from pdxfer import UnknownRequestError

    try:
        return engine.poll(rid)
    except UnknownRequestError:
        return None


def csv_indices(text: str) -> list[int]:
    """`"1,2,3"` -> [1, 2, 3]; `"-"` -> [] (the helper processes' index spelling)."""
    return [] if text == "-" else [int(v) for v in text.split(",")]


def serve(engine, handlers: dict) -> None:
    """The helper processes' command loop: one stdin line in, one flushed line out.

    `wait <rid>` and `quit` are common; `handlers[word](*args)` answers the rest.
    """
    import sys

    from pdxfer import RequestFailed

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "wait":
            try:
                engine.wait(words[1], 30.0)
                reply = f"OK {words[1]}"
            except RequestFailed as exc:
                reply = f"FAIL {words[1]} {exc.reason}"
        else:
            reply = handlers[words[0]](*words[1:])
        print(reply, flush=True)
    engine.close()


def settle(*engines, wait: float = 10.0) -> None:
    """Return once each engine's progress loop has run a full turn, tick included, since the call.

    After `ManualClock.advance` the loops are asked for a tick (`tick_soon`); a
    command queued now runs in the next turn, before that turn's tick, so the
    second command below runs only after a tick that saw the new time.
    """
    import threading

    for engine in engines:
        for _ in range(2):
            done = threading.Event()
            engine._progress.call(done.set)
            if not done.wait(wait):
                raise AssertionError(f"{engine.role} engine's progress loop made no turn in {wait} s")
