"""The decode side of the engine benchmarks, in this process or in a child process.

`pdxfer bench chunked` (and `bench engine --processes 2`) drive a real
`DecodeEngine` the way a decode worker does — `expect`, `wait`, `release` —
but from the benchmark's process. With `--processes 2` the engine runs in a
child started by `peer.ChildPeer(module="pdxfer.bench.decode_peer")`, so the
prefill's Python (its "forward pass", its sends) and the decode's receiving
threads share no GIL, as deployed; the operations travel on the same
msgpack pipe, each answered within a timeout.

Times cross the process boundary as `time.monotonic()` readings: on Linux
that clock is system-wide, so the prefill can subtract them from its own.
`wait` also returns a crc32 of the landed entries (every field, in request
order), which the prefill compares with its source entries' — a benchmark
that moved the wrong bytes stops instead of printing a number.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import Any

import numpy as np
import torch

from ..config import EngineConfig, KVPoll
from . import workload

OPS = ("open", "expect", "wait", "stats", "release", "bare", "reset", "cpu")


def entries_crc(pools: dict[str, Any], indices: dict[str, Any]) -> int:
    """crc32 of the named entries of each pool, field by field, in the order given."""
    crc = 0
    for name in sorted(indices):
        arena, idx = pools[name], np.asarray(indices[name], dtype=np.int64)
        for f in arena.fields:
            crc = zlib.crc32(arena.view(f.name)[:, idx].contiguous().view(torch.uint8).numpy(), crc)
    return crc


class DecodeSide:
    """A `DecodeEngine` over the benchmark's pools, driven one operation at a time."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host  # where its engines listen (the address the other host reached)
        self.engine: Any = None
        self.pools: dict[str, Any] = {}
        self._bare: list[Any] = []

    def open(self, backend: str, kind: str, kv_entries: int, state_entries: int) -> None:
        from ..decode import DecodeEngine

        self.pools = workload.pools(kind, kv_entries, state_entries)
        self.engine = DecodeEngine(self.pools, EngineConfig(transport=backend, timeout=30.0,
                                                            host=self.host))

    def expect(self, rids: list[str], addr: str, indices: list[dict[str, list[int]]]) -> None:
        for rid, idx in zip(rids, indices, strict=True):
            self.engine.expect(rid, addr, {p: np.asarray(v, dtype=np.int64) for p, v in idx.items()})

    def wait(self, rids: list[str], indices: list[dict[str, list[int]]] | None = None,
             timeout: float = 60.0) -> dict[str, Any]:
        """Wait for every request's Success: the monotonic time the last one was seen, and crc32s."""
        for rid in rids:
            state = self.engine.wait(rid, timeout)
            if state is not KVPoll.Success:
                raise RuntimeError(f"decode request {rid} ended {state.name}, not Success")
        t = time.monotonic()
        crcs = [entries_crc(self.pools, idx) for idx in indices] if indices else []
        return {"t": t, "crc": crcs}

    def stats(self, rids: list[str]) -> dict[str, list[int]]:
        """Segments and transfers each request took (what `bench engine` checks)."""
        got = [self.engine.stats(rid) for rid in rids]
        return {"segments": [g.segments for g in got], "transfers": [g.transfers for g in got]}

    def bare(self, backend: str, kind: str, kv_entries: int, state_entries: int) -> dict[str, Any]:
        """A bare transport engine with fresh pools' buffers registered: address and descriptors."""
        from pdxfer import layout, transport

        self._bare_pools = workload.pools(kind, kv_entries, state_entries)
        eng = transport.create(backend, host=self.host)
        self._bare.append(eng)
        return {"address": eng.address(),
                "descriptors": {p: [eng.register(b).descriptor() for b in layout.arena_buffers(a)]
                                for p, a in self._bare_pools.items()}}

    def cpu(self) -> float:
        """CPU seconds this process has used (every thread): what `bench engine` charges per request."""
        return time.process_time()

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.release(rid)

    def reset(self) -> None:
        """Close the engines and keep the process: one child serves every configuration."""
        self.close()

    def close(self) -> None:
        for eng in self._bare:
            eng.close()
        self._bare.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class LocalDecode:
    """A `DecodeSide` in this process, with `peer.LocalPeer`'s `call` signature."""

    def __init__(self) -> None:
        self.side = DecodeSide()

    def call(self, op: str, **kw: Any) -> Any:
        if op == "cpu":
            return 0.0  # the same process: its CPU is already counted on the prefill's side
        return getattr(self.side, op)(**kw)

    def close(self) -> None:
        self.side.close()


if __name__ == "__main__":
    from .peer import serve

    sys.exit(serve(DecodeSide(), OPS))
