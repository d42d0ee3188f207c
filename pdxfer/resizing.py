"""Moving a pool boundary under live PD traffic: what is in flight, what blocks, what peers hear.

`layout.ElasticPools` holds a page pool and a state pool in one allocation
and says which entries a boundary move relocates (`plan_resize`,
`relocate`). What layout cannot know is which entries a transfer is using
right now; an engine does, and this module is the engine's side of a
resize (`Engine.resize` drives it):

- Which entries are in flight: every unfinished request's entries of the
  pool that shrinks — a decode's destinations (expected, receiving,
  aborting, fencing or quarantined: until the request is Success or Failed
  a byte may still land), a prefill's sources of every chunk it accepted
  (queued or posted: until the request finishes its transfers may still
  read them). Each record says which of our entries it holds (`held`).
- What blocks a resize: a request holding an entry the move vacates or
  hands to a moved entry. Such a resize is refused naming the request ids
  (`ResizeBlockedError`), or waits (bounded) for them to finish. A Failed
  request no longer blocks: Failed already means no byte of it lands or is
  read any more, whatever fence, abort or quarantine got it there — so a
  resize inherits those guarantees instead of adding its own.
- What peers hear: a decode's pools' new live ranges (`LiveRange`), queued
  on every control link before any later Expect, so a prefill never plans
  a destination against an older range than the one the decode named it
  under; the prefill applies it to its routes (`apply_live_range`), which
  then refuse destinations outside it. A prefill announces nothing: no peer
  reads or writes its entries (writes are the prefill's one-sided pushes).

The registration does not change: the allocation is registered once, whole,
and a move only changes which of its entries each pool may name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdxfer import layout
from pdxfer.transport.errors import ProtocolError

from .errors import RequestError, ResizeBlockedError
from .pools import PoolSet, Route, peer_range
from .protocol import LiveRange


@dataclass(frozen=True)
class ResizeReport:
    """What one `Engine.resize` did: the plan, the moves, and what they cost.

    `moved` maps each relocated entry's old index to its new one (apply it
    to the allocator's and the scheduler's tables); `copy_s` is the
    relocation's own time, `waited_s` the time spent waiting for blocking
    requests (`wait=`).
    """

    pools: tuple[str, str]  # (page pool name, state pool name)
    plan: layout.ResizePlan
    moved: layout.IndexMap
    copy_s: float
    waited_s: float

    @property
    def entries(self) -> int:
        """Entries relocated."""
        return self.plan.entries

    @property
    def nbytes(self) -> int:
        """Bytes relocated."""
        return self.plan.nbytes


def pool_names(arenas: Mapping[str, Any], pools: layout.ElasticPools) -> tuple[str, str]:
    """`(page pool name, state pool name)` under which this engine serves `pools`, or refused."""
    if not isinstance(pools, layout.ElasticPools):
        raise RequestError(f"resize needs the layout.ElasticPools to move, got {type(pools).__name__}")
    page = [n for n, a in arenas.items() if a is pools.page]
    state = [n for n, a in arenas.items() if a is pools.state]
    if len(page) != 1 or len(state) != 1:
        raise RequestError(
            f"this engine does not serve these ElasticPools (its pools: {sorted(arenas)}); "
            "build the engine with {name: pools.page, name2: pools.state} and resize only "
            "through the engine, which keeps its pools current"
        )
    return page[0], state[0]


def blocking(requests: Iterable[Any], pool: str, plan: layout.ResizePlan) -> list[str]:
    """Ids of the requests holding an entry of `pool` that `plan` vacates or moves one into."""
    lo, hi = plan.vacated
    into = plan.moves.new
    out = []
    for req in requests:  # a loop per request, vectorised over its entries
        for idx in req.held(pool):
            if idx.size and (bool(np.any((idx >= lo) & (idx < hi)))
                             or (into.size and bool(np.isin(idx, into).any()))):
                out.append(req.id)
                break
    return sorted(out)


def blocked(role: str, pool: str, plan: layout.ResizePlan, rids: list[str],
            waited: float | None) -> ResizeBlockedError:
    """The refusal naming the requests in the way (`waited`: the bound we waited, if any)."""
    lo, hi = plan.vacated
    shown = ", ".join(repr(r) for r in rids[:8]) + (f" and {len(rids) - 8} more" if len(rids) > 8 else "")
    after = f" after waiting {waited} s" if waited is not None else ""
    return ResizeBlockedError(
        f"resize of the {role}'s boundary {plan.old_boundary} -> {plan.boundary} refused{after}: "
        f"request(s) {shown} still hold pool {pool!r} entries it would move or retire "
        f"(slots {lo}..{hi - 1}, or a slot an entry moves into); resize once they finished, "
        "or pass wait=seconds", rids)


def live_range(pools: PoolSet, names: Iterable[str]) -> LiveRange:
    """The `LiveRange` announcing pools `names` as they are now described."""
    return LiveRange({n: [int(pools.descs[n]["entries"]), int(pools.descs[n]["live_entries"])]
                      for n in names})


def apply_live_range(routes: Mapping[str, Route], msg: LiveRange) -> None:
    """A decode's new live ranges into its routes (engine lock held): all, or `ProtocolError`."""
    if not isinstance(msg.pools, dict):
        raise ProtocolError("live_range: pools must be a map pool -> [entries, live_entries]")
    ranges = {}
    for name, value in msg.pools.items():
        if name not in routes:
            raise ProtocolError(f"live_range names pool {name!r}, which this prefill does not serve")
        if not isinstance(value, list) or len(value) != 2:
            raise ProtocolError(f"live_range: pool {name!r} range must be [entries, live_entries]")
        ranges[name] = peer_range(name, *value)
    for name, (entries, live) in ranges.items():
        routes[name].set_peer_range(entries, live)
