"""A request served by tensor-parallel ranks of different sizes, over the public engine API.

Prefill runs TP=P, decode TP=D. Each rank has its own engine over its own
shard-major pools (`layout.ShardMajorArena`), and each (prefill rank, decode
rank) pair that shares heads is an ordinary engine request — a *sub-request*
with a derived id (`sub_request_id`) — whose route plans the rank pair
(`layout.rank_pair`, one segment per entry). Which pairs exist is layout's
answer (`layout.contributing_ranks`), asked with the same numbers on both
sides, so a prefill rank sends exactly the sub-requests its decode ranks
expect without any message of our own.

This module composes; it adds no wire message, thread or state machine:

- `HeteroTPDecode.expect(rid, prefill_group, indices)`: one `expect()` per
  contributing prefill rank (the group is the prefill ranks' addresses in
  rank order, a list or `group_address`'s comma-joined string).
- `HeteroTPPrefill.send(rid, indices, decode_tp=D)`: one `send()` per decode
  rank this prefill rank contributes to (none is fine: Success at once).
- `poll`/`wait`: Success when every sub-request succeeded, and never
  otherwise. When one fails (or is Quarantined), the others are aborted;
  Failed is reported only once every sub-request has finished, so the
  engine's per-request guarantee (no byte lands after Failed) holds for the
  whole request. `abort` aborts them all.
- A refused call leaves no request behind: `expect` runs every check the
  engine would on each sub-request before the first exists; should the
  engine still refuse one (a duplicate id it alone knows), the siblings
  already expected are aborted, the request is forgotten here
  (`UnknownRequestError`), and those siblings are released once finished.

Propagation is through shared ranks: a failed pair aborts its siblings on both
of its ranks, whose peers then fail theirs. Decode ranks that share no prefill
rank (4 -> 2: ranks 0 and 1 read disjoint prefill ranks) cannot hear of each
other here; a decode TP group agrees on a request's outcome the way it agrees
on everything else, by its scheduler's collective (SGLang all-reduces KVPoll).
Failure is noticed when the caller polls or waits; the scheduler loop does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pdxfer import layout

from .config import KVPoll, RequestStats
from .decode import DecodeEngine
from .directory.records import PeerRecord
from .errors import ConfigError, RequestError, RequestFailed, TransferTimeout, UnknownRequestError
from .expects import expect_destinations
from .prefill import PrefillEngine
from .requests import check_request_id

# Longest single engine wait inside `wait`, so a sibling's failure is seen
# within this even while another sub-request is quiet.
_WAIT_SLICE = 0.05


def sub_request_id(request_id: str, prefill_rank: int, decode_rank: int) -> str:
    """The engine request id of one rank pair's part of `request_id`."""
    return f"{check_request_id(request_id)}#tp{int(prefill_rank)}>{int(decode_rank)}"


def group_address(addresses: Sequence[str]) -> str:
    """A prefill group's addresses (rank order) as one string a router can pass along."""
    return ",".join(_group(addresses))


def _group(group: str | Sequence[Any]) -> list[Any]:
    addrs = group.split(",") if isinstance(group, str) else list(group)
    if not addrs or not all(isinstance(a, str) and a or isinstance(a, PeerRecord) for a in addrs):
        raise RequestError(
            f"a prefill group is its ranks' addresses (or directory records) in rank order, "
            f"got {group!r}"
        )
    return addrs


def _splits(pools: Mapping[str, Any]) -> tuple[int, int, dict[str, bool]]:
    """`(tp, rank, {pool: has split fields})`; non-shard pools count as replicated."""
    ranks = {(a.tp, a.rank) for a in pools.values() if isinstance(a, layout.ShardMajorArena)}
    if len(ranks) > 1:
        raise ConfigError(f"one rank's pools disagree on (TP size, rank): {sorted(ranks)}")
    tp, rank = ranks.pop() if ranks else (1, 0)
    split = {name: isinstance(a, layout.ShardMajorArena) and a.geometry.units > 0
             for name, a in pools.items()}
    return tp, rank, split


class _Group:
    """The sub-requests of each request on one rank, read and aborted together."""

    def __init__(self, engine: Any, pools: Mapping[str, Any]) -> None:
        self.engine = engine
        self.tp, self.rank, self._split = _splits(pools)
        self._arenas = dict(pools)
        self._lock = threading.Lock()
        self._subs: dict[str, list[str]] = {}
        self._aborted: set[str] = set()
        # Sub-requests of refused calls: aborted, released here once finished.
        self._orphans: list[str] = []

    def _add(self, request_id: str, subs: list[str]) -> None:
        with self._lock:
            if request_id in self._subs:
                raise RequestError(f"request {request_id!r} is already in this TP group")
            self._subs[request_id] = subs
            self._release_orphans()

    def _forget(self, request_id: str, started: list[str], reason: str) -> None:
        """Undo a refused call: abort the sub-requests it started and forget the request."""
        for sub in started:
            self.engine.abort(sub, reason)
        with self._lock:
            self._subs.pop(request_id, None)
            self._orphans += started

    def _release_orphans(self) -> None:
        """Release the orphans that have finished (lock held; the engine's reads never wait)."""
        keep = []
        for sub in self._orphans:
            try:
                if self.engine.poll(sub).finished:
                    self.engine.release(sub)
                    continue
            except UnknownRequestError:
                continue
            keep.append(sub)
        self._orphans = keep

    def _get(self, request_id: str) -> list[str]:
        with self._lock:
            try:
                return self._subs[check_request_id(request_id)]
            except KeyError:
                raise UnknownRequestError(
                    f"no request {request_id!r} in this TP group: never expected or sent here, "
                    "refused, or already released"
                ) from None

    def sub_requests(self, request_id: str) -> list[str]:
        """The engine request ids `request_id` is made of on this rank."""
        return list(self._get(request_id))

    def poll(self, request_id: str) -> KVPoll:
        """Success only when every sub-request succeeded; Failed once a failure has drained.

        Otherwise the least advanced running state — except that a failed
        sub-request still Quarantined (5, which sorts above Success) makes
        the whole request Quarantined: failed, entries not yet the caller's.
        """
        subs = self._get(request_id)
        states = [self.engine.poll(s) for s in subs]
        failed = (KVPoll.Failed, KVPoll.Quarantined)
        if not any(s in failed for s in states):
            return min(states, default=KVPoll.Success)  # no sub-request: a prefill rank with no part
        if request_id not in self._aborted:
            self._aborted.add(request_id)
            reason = self.failure_reason(request_id) or "failed"
            for sub, state in zip(subs, states, strict=True):
                if not state.finished and state is not KVPoll.Quarantined:
                    self.engine.abort(sub, f"a sibling rank pair failed: {reason}")
            states = [self.engine.poll(s) for s in subs]
        if KVPoll.Quarantined in states:
            return KVPoll.Quarantined
        return KVPoll.Failed if all(s.finished for s in states) else min(
            s for s in states if not s.finished)

    def failure_reason(self, request_id: str) -> str | None:
        """The first failed sub-request's reason, naming it."""
        for sub in self._get(request_id):
            reason = self.engine.failure_reason(sub)
            if reason is not None and self.engine.poll(sub) in (KVPoll.Failed, KVPoll.Quarantined):
                return f"{sub}: {reason}"
        return None

    def wait(self, request_id: str, timeout: float | None = None) -> KVPoll:
        """Block until Success; `RequestFailed` once failed and drained; `TransferTimeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.poll(request_id)
            if state is KVPoll.Success:
                return state
            if state is KVPoll.Failed:
                raise RequestFailed(request_id, self.failure_reason(request_id) or "failed")
            left = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"request {request_id!r} still {state.name} after "
                                      f"{timeout} s; wait again, or abort() it")
            running = [s for s in self._get(request_id) if not self.engine.poll(s).finished]
            try:
                if running:
                    self.engine.wait(running[0], min(left, _WAIT_SLICE))
            except (TransferTimeout, RequestFailed):
                pass  # the next poll reads it

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Abort every sub-request; Failed once none of them can land a byte."""
        with self._lock:
            self._aborted.add(check_request_id(request_id))
        for sub in self._get(request_id):
            self.engine.abort(sub, reason)

    def stats(self, request_id: str) -> RequestStats:
        """Bytes, segments and transfers summed over the sub-requests; the longest elapsed."""
        parts = [self.engine.stats(s) for s in self._get(request_id)]
        return RequestStats(sum(p.nbytes for p in parts), sum(p.segments for p in parts),
                            sum(p.transfers for p in parts), max((p.elapsed_s for p in parts),
                                                                 default=0.0),
                            max((p.wire_s for p in parts), default=0.0))

    def release(self, request_id: str) -> None:
        """Release every (finished) sub-request and forget the request."""
        for sub in self._get(request_id):
            self.engine.release(sub)
        with self._lock:
            del self._subs[request_id]
            self._aborted.discard(request_id)


class HeteroTPDecode(_Group):
    """One decode rank's side of requests whose prefill runs another TP size."""

    def __init__(self, engine: DecodeEngine, pools: Mapping[str, Any]) -> None:
        super().__init__(engine, pools)

    def expect(self, request_id: str, prefill_group: str | Sequence[str] | Sequence[PeerRecord],
               indices: Mapping[str, Any]) -> None:
        """Expect `request_id` from every prefill rank that holds heads (or replicas) we need.

        `prefill_group` is the ranks' addresses in rank order, or their
        directory records (`PeerDirectory.group(...)`), which are checked
        against our pools before anything is dialed. `indices` are this
        rank's destination entries per pool, as for `DecodeEngine.expect`;
        each contributing prefill rank fills its part of them. Refusals come
        before any sub-request exists.
        """
        rid = check_request_id(request_id)
        addrs = _group(prefill_group)
        if not isinstance(indices, Mapping) or not indices:
            raise RequestError(f"expect({rid!r}): indices must be a non-empty mapping pool -> indices")
        unknown = sorted(set(indices) - set(self._split))
        if unknown:
            raise RequestError(f"expect({rid!r}): no pool(s) {unknown} in this TP group")
        addrs = [self.engine.check_prefill(a) for a in addrs]
        plan: dict[int, dict[str, Any]] = {}
        for pool, idx in indices.items():
            for p in layout.contributing_ranks(len(addrs), self.tp, self.rank, split=self._split[pool]):
                plan.setdefault(p, {})[pool] = idx
        subs = [sub_request_id(rid, p, self.rank) for p in sorted(plan)]
        for p, sub in zip(sorted(plan), subs, strict=True):  # what engine.expect would refuse
            check_request_id(sub)  # addresses: check_prefill above
            plan[p] = expect_destinations(self._arenas, sub, plan[p])
        self._add(rid, subs)
        done: list[str] = []
        try:
            for p, sub in zip(sorted(plan), subs, strict=True):
                self.engine.expect(sub, addrs[p], plan[p])
                done.append(sub)
        except BaseException:
            self._forget(rid, done, "a sibling expect was refused")
            raise


class HeteroTPPrefill(_Group):
    """One prefill rank's side of requests whose decode runs another TP size."""

    def __init__(self, engine: PrefillEngine, pools: Mapping[str, Any]) -> None:
        super().__init__(engine, pools)

    def send(self, request_id: str, indices: Mapping[str, Any], *, decode_tp: int,
             last: bool = True, checkpoint: bool = False, ready: Any = None) -> None:
        """Send this rank's part of `request_id` to every decode rank it contributes to.

        Call it like `PrefillEngine.send` (once per chunk, `ready` as there);
        `decode_tp` is the decode group's TP size, which the router knows.
        """
        rid = check_request_id(request_id)
        if isinstance(decode_tp, bool) or not isinstance(decode_tp, int) or decode_tp < 1:
            raise RequestError(f"send({rid!r}): decode_tp must be a positive int, got {decode_tp!r}")
        unknown = sorted(set(indices) - set(self._split))
        if unknown:
            raise RequestError(f"send({rid!r}): no pool(s) {unknown} in this TP group")
        plan: dict[int, dict[str, Any]] = {}
        for q in range(decode_tp):
            for pool, idx in indices.items():
                if self.rank in layout.contributing_ranks(self.tp, decode_tp, q,
                                                          split=self._split[pool]):
                    plan.setdefault(q, {})[pool] = idx
        subs = [sub_request_id(rid, self.rank, q) for q in sorted(plan)]
        with self._lock:
            known = self._subs.get(rid)
        if known is None:
            self._add(rid, subs)
        elif known != subs:
            raise RequestError(f"send({rid!r}): decode_tp changed between chunks")
        done: list[str] = []
        try:
            for q, sub in zip(sorted(plan), subs, strict=True):
                self.engine.send(sub, plan[q], last=last, checkpoint=checkpoint, ready=ready)
                done.append(sub)
        except BaseException:
            if known is None:  # the call that created the request: refused, it leaves none
                self._forget(rid, done, "a sibling send was refused")
            raise
