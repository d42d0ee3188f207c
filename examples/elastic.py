"""The demo's elastic pools: pages and states in one allocation, the boundary moved mid-run.

With `--resize-every N` each worker keeps its `kv` pages and its `state`
entries in one `layout.ElasticPools` (slot `i` is page `i` below the
boundary, state `i` above it) and moves the boundary every N requests,
alternately growing the state pool by `--resize-step` slots and shrinking
it back. It does so in the middle of a request, while that request's
entries hold live data the model still reads: the decode worker after its
caches landed and before it decodes, the prefill worker after it ran the
prompt and before it sends. The request then goes on from the moved
entries (`IndexMap.remap`), so "outputs identical" also checks every
relocated byte.

The entries come from `caches.SlotAllocator`, which hands out the free
entry nearest the boundary first: the worst case for a resize, so every
move of the demo relocates live entries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pdxfer.layout import ElasticPools

from .caches import SHARED


@dataclass(frozen=True)
class ResizeFigures:
    """One boundary move, as the demo prints it."""

    worker: str
    request_id: str
    old_boundary: int
    boundary: int
    state_before: int
    state_after: int
    entries: int
    nbytes: int
    copy_s: float

    def line(self) -> str:
        verb = "grows" if self.state_after > self.state_before else "shrinks"
        return (f"  resize on {self.worker:<8}during {self.request_id}: state pool {verb} "
                f"{self.state_before} -> {self.state_after} entries (boundary "
                f"{self.old_boundary} -> {self.boundary}): moved {self.entries} "
                f"{'entry' if self.entries == 1 else 'entries'}, "
                f"{self.nbytes:,} B in {self.copy_s * 1e3:.3f} ms")


def figures_to_wire(f: ResizeFigures) -> dict[str, Any]:
    return asdict(f)


def figures_from_wire(d: Any) -> ResizeFigures:
    """A resize record from a worker, checked (the wire checks only the top level)."""
    try:
        return ResizeFigures(
            worker=str(d["worker"]), request_id=str(d["request_id"]),
            **{k: int(d[k]) for k in ("old_boundary", "boundary", "state_before", "state_after",
                                      "entries", "nbytes")},
            copy_s=float(d["copy_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        from pdxfer.transport.errors import PeerLostError

        raise PeerLostError(f"malformed resize figures from a worker: {d!r}") from exc


class BoundaryMover:
    """Moves one worker's boundary every `every` requests, `step` slots, alternately down and up."""

    def __init__(self, worker: str, caches: Any, engine: Any, every: int, step: int) -> None:
        self.worker, self.caches, self.engine = worker, caches, engine
        self.every, self.step = every, step
        self.requests = 0
        self.moves = 0

    def maybe(self, rid: str, held: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                                       list[dict[str, Any]]]:
        """After a request's entries were written: move the boundary if it is time.

        Returns the request's entries as they are after the move, and the
        move's figures (wire form) to report; none if it was not time.
        """
        self.requests += 1
        if not self.every or self.requests % self.every:
            return held, []
        pools: ElasticPools = self.caches.elastic
        old = pools.boundary
        grow = self.moves % 2 == 0  # the state pool grows, then shrinks back, ...
        target = max(0, old - self.step) if grow else min(pools.slots, old + self.step)
        shrinking = SHARED[0] if target < old else SHARED[1]
        report = self.engine.resize(pools, target, self.caches.slots.in_use(shrinking))
        self.caches.moved(report.moved)
        self.moves += 1
        held = {name: report.moved.remap(idx) if name in SHARED else idx
                for name, idx in held.items()}
        figures = ResizeFigures(self.worker, rid, old, target, pools.slots - old,
                                pools.slots - target, report.entries, report.nbytes, report.copy_s)
        return held, [figures_to_wire(figures)]
