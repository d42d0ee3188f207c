"""Many decode engines in one process: the receiving side of `pdxfer bench peers`.

`bench peers` measures one prefill against 1 … 128 decode peers. A process
per decode would measure process start-up, not pdxfer, so a child process
holds a *fleet* of real `DecodeEngine`s (each its own transport engine,
progress thread and pools), driven over the same msgpack pipe as the other
bench children (`peer.serve`): `open` adds engines, `expect` announces a
batch of requests, `settle` waits for and releases them, `usage` reports
the process's resident memory and threads. For the fan-in half (one
receiving transport engine, many senders) `senders` adds bare transport
engines that each connect to the receiver and write once.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from ..config import EngineConfig, KVPoll
from . import procstat

OPS = ("open", "expect", "settle", "senders", "usage", "reset")


class DecodeFleet:
    """Decode engines of one backend, added in groups, each with its own pool."""

    def __init__(self) -> None:
        self.engines: list[Any] = []
        self.pools: list[Any] = []
        self.rids: list[list[str]] = []
        self.bare: list[Any] = []

    def open(self, backend: str, count: int, entries: int, options: dict[str, Any],
             timeout: float) -> int:
        """Add `count` decode engines whose kv pools hold `entries` pages; the fleet's size."""
        from ..decode import DecodeEngine
        from . import peers

        cfg = EngineConfig(transport=backend, timeout=timeout, transport_options=options)
        for _ in range(count):
            pools = {"kv": peers.pool(entries)}
            self.engines.append(DecodeEngine(pools, cfg))
            self.pools.append(pools)
            self.rids.append([])
        return len(self.engines)

    def expect(self, addr: str, batch: list[list[Any]]) -> None:
        """`[engine, rid, first page, pages]` each: announce the request (pages first..first+pages)."""
        for engine, rid, first, pages in batch:
            self.engines[engine].expect(rid, addr, {"kv": np.arange(first, first + pages)})
            self.rids[engine].append(rid)

    def settle(self, timeout: float) -> int:
        """Wait for every announced request to succeed, then release them all; how many."""
        n = 0
        deadline = time.monotonic() + timeout
        for engine, rids in zip(self.engines, self.rids, strict=True):
            for rid in rids:
                state = engine.wait(rid, max(0.1, deadline - time.monotonic()))
                if state is not KVPoll.Success:
                    raise RuntimeError(f"decode request {rid} ended {state.name}")
                engine.release(rid)
                n += 1
            rids.clear()
        return n

    def senders(self, backend: str, count: int, address: dict[str, Any], descriptor: dict[str, Any],
                options: dict[str, Any], first: int) -> None:
        """Add `count` transport engines that each connect to `address` and write 4 KiB once, with a notify.

        Sender `first + i` writes its own 4 KiB slot of the receiver's region,
        notify payload its number; returns once every write completed.
        """
        import torch

        from pdxfer import transport

        handles = []
        for i in range(first, first + count):
            eng = transport.create(backend, **options)
            self.bare.append(eng)
            src = eng.register(torch.full((4096,), i % 251, dtype=torch.uint8))
            table = np.array([[0, i * 4096, 4096]], dtype=np.int64)
            handles.append(eng.connect(address).write(src, descriptor, table, notify=b"%d" % i))
        for h in handles:
            h.wait(60.0)

    def usage(self) -> dict[str, int]:
        """This process's resident memory and threads (`procstat`)."""
        return procstat.usage()

    def reset(self) -> None:
        """Close every engine and keep the process (the next backend reuses it)."""
        self.close()

    def close(self) -> None:
        for engine in self.bare + self.engines:
            engine.close()
        self.bare.clear()
        self.engines.clear()
        self.pools.clear()
        self.rids.clear()


if __name__ == "__main__":
    from .peer import serve

    sys.exit(serve(DecodeFleet(), OPS))
