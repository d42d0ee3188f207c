"""The `PeerDirectory` contract, and the part every implementation shares: the local view.

A directory answers three questions for a process: where is the rank for a
slot (`resolve`), which complete TP group serves (model, role, instance, dp)
(`group`), and what changed (`subscribe`: "up", "down", "replaced"). Every
answer comes from a local cache — a dict, no I/O — so a router or an engine
may ask on its hot path; the implementations differ only in how the cache is
fed (an in-process hub, a fixed table, an etcd watch) and in how a
registration is made to last (nothing, nothing, a lease).

What the events mean, everywhere:

- "up": a slot got a record (new, or back after "down", or re-put changed).
- "down": the slot's record is gone — unregistered, or its holder's lease
  expired. Advisory: stop routing new requests there. It never fails a
  request already bound to that peer; the control link decides those.
- "replaced": the slot's record now names another engine id: a new
  incarnation. Two live processes cannot hold one slot (`claim`), so this
  proves the old one is gone; an engine cuts its links to the old engine
  before dialing the new one.

Subscribers are called on the directory's own thread, in event order,
outside every lock; one that raises is logged and the others still run.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .errors import DirectoryError, RecordError, SlotTakenError
from .records import PeerRecord, Slot, check_name

log = logging.getLogger("pdxfer.directory")

EVENTS = ("up", "down", "replaced")


@dataclass(frozen=True)
class DirectoryEvent:
    """One change of one slot, as subscribers see it."""

    kind: str  # "up" | "down" | "replaced"
    slot: Slot
    record: PeerRecord | None  # the record now (None for "down")
    old: PeerRecord | None  # the record before (None for a first "up")


@dataclass(frozen=True)
class DirectoryHealth:
    """Whether the directory's view is being kept current, and since when it is not."""

    connected: bool
    revision: int  # the store revision the view reflects (0 where there is no store)
    since: float  # time.monotonic() of the last change of `connected`
    reason: str = ""  # why not connected
    skipped: int = 0  # stored values refused as unreadable so far (each skipped, none fatal)

    @property
    def degraded(self) -> bool:
        return not self.connected


Subscriber = Callable[[DirectoryEvent], None]


def claim(slot: Slot, held: PeerRecord | None, new: PeerRecord, takeover: bool) -> str:
    """How a registration of `new` treats the slot's current record: "up", "same" or "replaced".

    Refused (`SlotTakenError`) when another engine at another address holds
    it: two processes configured for one slot, or a restart on a new address
    before the old holder's lease expired. A new engine at the *same* address
    is a restart in place — the registrant listens there now, so the old
    process cannot — and takes the slot over.
    """
    if held is None:
        return "up"
    if held.engine == new.engine:
        return "same"
    if takeover or held.address == new.address:
        return "replaced"
    raise SlotTakenError(
        f"slot {slot.path()} is held by engine {held.engine} at {held.address}; a second process "
        "for one slot? Give each its own instance/rank, wait for the old holder's lease to "
        "expire, or register with takeover=True if it is known to be dead")


def event_for(slot: Slot, old: PeerRecord | None, new: PeerRecord | None) -> DirectoryEvent | None:
    """The event a change of `slot` from `old` to `new` is, or None if nothing changed."""
    if new is None:
        return None if old is None else DirectoryEvent("down", slot, None, old)
    if old is None:
        return DirectoryEvent("up", slot, new, None)
    if old.engine != new.engine:
        return DirectoryEvent("replaced", slot, new, old)
    return None if old == new else DirectoryEvent("up", slot, new, old)


class PeerDirectory(ABC):
    """Register this process's ranks; resolve, group and follow everyone's. See the module doc."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._records: dict[Slot, PeerRecord] = {}
        # (model, role) -> instance -> dp -> tp -> record: `group` and `instances`
        # read this, so a router's per-request pick costs its instances, not every record.
        self._index: dict[tuple[str, str], dict[str, dict[int, dict[int, PeerRecord]]]] = {}
        self._layouts: dict[str, dict] = {}
        self._subscribers: list[Subscriber] = []
        self._notify_lock = threading.Lock()  # one delivery at a time keeps event order
        self._closed = False

    # -- what differs ---------------------------------------------------------------
    @abstractmethod
    def register(self, slot: Slot, record: PeerRecord, layouts: Mapping[str, dict] | None = None,
                 *, takeover: bool = False) -> None:
        """Publish `record` for `slot` (for as long as this process lives) and `layouts` once.

        `layouts` is `{fingerprint: description}` (`records.engine_record`
        builds both). Refuses a slot held by another live engine (`claim`).
        """

    @abstractmethod
    def unregister(self, slot: Slot) -> None:
        """Withdraw this process's record for `slot` (peers see "down"); no-op if not ours."""

    @abstractmethod
    def health(self) -> DirectoryHealth:
        """Whether the view is current (`connected`), its revision, and why not."""

    def close(self) -> None:
        """Withdraw this process's records and stop following; idempotent."""
        self._closed = True

    # -- the shared view (no I/O) -----------------------------------------------------
    def resolve(self, slot: Slot) -> PeerRecord | None:
        """The record holding `slot` now, or None."""
        with self._cond:
            return self._records.get(slot)

    def peers(self, model: str, role: str) -> dict[Slot, PeerRecord]:
        """Every record of (model, role) this directory follows, by slot."""
        with self._cond:
            return {r.slot: r for dps in self._index.get((model, role), {}).values()  # type: ignore[misc]
                    for tps in dps.values() for r in tps.values()}

    def group(self, model: str, role: str, instance: str, dp: int = 0) -> list[PeerRecord] | None:
        """The TP group of (model, role, instance, dp) in rank order, or None while incomplete.

        Complete means every rank 0..tp_size-1 is registered and all agree on
        tp_size and dp_size.
        """
        with self._cond:
            return self._group(model, role, instance, dp)

    def _group(self, model: str, role: str, instance: str, dp: int) -> list[PeerRecord] | None:
        ranks = self._index.get((model, role), {}).get(instance, {}).get(dp)
        if not ranks:
            return None
        sizes = {(r.tp_size, r.dp_size) for r in ranks.values()}
        if len(sizes) != 1:
            return None
        tp_size = next(iter(sizes))[0]
        # count first: the size comes from a record, so never build a list of it
        if len(ranks) != tp_size or any(not 0 <= t < tp_size for t in ranks):
            return None
        return [ranks[t] for t in range(tp_size)]

    def instances(self, model: str, role: str) -> list[str]:
        """Instances of (model, role) whose every DP group is complete, sorted: what a router picks from."""
        with self._cond:
            names = sorted(self._index.get((model, role), {}))
            out = []
            for name in names:
                first = self._group(model, role, name, 0)
                if first is not None and all(self._group(model, role, name, dp) is not None
                                             for dp in range(1, first[0].dp_size)):
                    out.append(name)
            return out

    def wait_group(self, model: str, role: str, instance: str, dp: int = 0,
                   timeout: float = 10.0) -> list[PeerRecord]:
        """`group(...)` once complete; `DirectoryError` naming what is missing after `timeout` s."""
        got: list[list[PeerRecord]] = []

        def complete() -> bool:
            group = self._group(model, role, instance, dp)
            if group is not None:
                got.append(group)
            return group is not None

        if self.wait_for(complete, timeout):
            return got[-1]
        have = sorted(s.tp for s in self.peers(model, role) if (s.instance, s.dp) == (instance, dp))
        raise DirectoryError(f"group {model}/{role}/{instance} dp {dp} incomplete after {timeout} s: "
                             f"ranks {have} registered; is every rank started, with one tp_size?")

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` holds (re-checked on every change of the view) or `timeout`.

        The predicate runs under the view's (re-entrant) lock, so it may call
        `resolve`/`group`; it must not block.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def layout(self, fingerprint: str) -> dict | None:
        """The description published under `fingerprint` (of the roles followed), or None."""
        with self._cond:
            return self._layouts.get(fingerprint)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(event)` on every change from now on; returns the call that stops it."""
        with self._cond:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._cond:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    # -- for implementations ------------------------------------------------------------
    def _apply(self, changes: Iterable[tuple[Slot, PeerRecord | None]],
               layouts: Mapping[str, dict] | None = None) -> None:
        """Set slots to records (None: gone), then tell subscribers what that changed."""
        with self._notify_lock:
            with self._cond:
                events = []
                for slot, record in changes:
                    old = self._records.get(slot)
                    self._set(slot, record)
                    event = event_for(slot, old, record)
                    if event is not None:
                        events.append(event)
                if layouts:
                    self._layouts.update(layouts)
                subscribers = list(self._subscribers)
            self._deliver(events, subscribers)
            with self._cond:  # after delivery: a waiter also sees what subscribers did
                self._cond.notify_all()

    def _set(self, slot: Slot, record: PeerRecord | None) -> None:
        """One slot of the view and its index (lock held)."""
        instances = self._index.setdefault((slot.model, slot.role), {})
        if record is None:
            self._records.pop(slot, None)
            dps = instances.get(slot.instance, {})
            dps.get(slot.dp, {}).pop(slot.tp, None)
            if not dps.get(slot.dp, True):
                del dps[slot.dp]
            if not dps:
                instances.pop(slot.instance, None)
            return
        self._records[slot] = record
        instances.setdefault(slot.instance, {}).setdefault(slot.dp, {})[slot.tp] = record

    def _resync(self, model: str, role: str, snapshot: Mapping[Slot, PeerRecord],
                layouts: Mapping[str, dict] | None = None) -> None:
        """Replace the view of (model, role) by a full listing: missing slots go "down"."""
        with self._cond:
            gone = [s for s in self.peers(model, role) if s not in snapshot]
        self._apply([*((s, None) for s in gone), *snapshot.items()], layouts)

    @staticmethod
    def _deliver(events: list[DirectoryEvent], subscribers: list[Subscriber]) -> None:
        for event in events:
            for fn in subscribers:
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 — one subscriber's bug must not stop the others
                    log.exception("pdxfer directory: subscriber %r failed on %s", fn, event.kind)

    def _check_open(self) -> None:
        if self._closed:
            raise DirectoryError(f"{type(self).__name__} is closed")

    def __enter__(self) -> PeerDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_cluster(cluster: str) -> str:
    """A cluster id (the namespace every key lives under), checked."""
    return check_name("cluster", cluster)


def check_record(slot: Slot, record: PeerRecord) -> None:
    """`record` is a PeerRecord for `slot`, whose rank lies inside its own sizes; or `DirectoryError`."""
    if not isinstance(record, PeerRecord) or record.slot != slot:
        raise DirectoryError(f"register({slot.path()}): the record must be a PeerRecord for that "
                             f"slot, got {record!r:.200}")
    # what a peer would refuse is refused here, before anything is written: the same bounds.
    # A static record (a bare address, no engine id) is never stored nor decoded: not checked.
    if record.engine is not None:
        _check_readable(slot, record)
    if slot.tp >= record.tp_size or slot.dp >= record.dp_size:
        raise DirectoryError(f"register({slot.path()}): rank outside the record's sizes "
                             f"(tp_size {record.tp_size}, dp_size {record.dp_size})")


def _check_readable(slot: Slot, record: PeerRecord) -> None:
    """`record` encodes, and decodes back under every bound a peer applies; or `DirectoryError`."""
    try:
        value = record.encode()
    except (TypeError, ValueError) as exc:
        raise DirectoryError(f"register({slot.path()}): the record does not encode as JSON "
                             f"(meta must hold JSON values): {exc}") from exc
    try:
        PeerRecord.decode(slot, value)
    except RecordError as exc:
        raise DirectoryError(f"register({slot.path()}): a peer would refuse this record: "
                             f"{exc}") from exc
