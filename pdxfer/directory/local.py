"""Directories without a store: in-process (`LocalDirectory`) and fixed (`StaticDirectory`).

`LocalDirectory` is the contract with the network taken out: several
directories on one `LocalHub` stand for several processes on one store, each
with its own view and subscribers, every change delivered to all of them at
once on the changing thread. A hub has no leases; a test makes a holder
"depart" (`LocalHub.depart`, as if its lease expired) or makes a process
"expire" (`LocalHub.expire`) instantly, so directory logic is tested without
waiting out a TTL. It serves one host as well as tests.

`StaticDirectory` is today's explicit addresses in the directory's shape: a
table fixed at construction (`from_groups(model, {instance: "h:p,h:p"})`),
whose records know only an address — no engine id, no fingerprints — so an
engine given one of them checks nothing and dials, exactly as it does for a
plain `host:port`. Every existing call site keeps working through it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from .base import DirectoryHealth, PeerDirectory, check_record, claim
from .errors import DirectoryError
from .records import PeerRecord, Slot


class LocalHub:
    """The shared store of a set of `LocalDirectory`s: records with their owners, layouts."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._records: dict[Slot, tuple[PeerRecord, LocalDirectory]] = {}
        self._layouts: dict[str, dict] = {}
        self._members: list[LocalDirectory] = []

    def join(self, member: LocalDirectory) -> None:
        """Add `member`; it receives every record held now, then every change."""
        with self._lock:
            self._members.append(member)
            member.receive([(s, r) for s, (r, _) in self._records.items()], dict(self._layouts))

    def leave(self, member: LocalDirectory) -> None:
        """Remove `member` and every record it holds."""
        with self._lock:
            if member in self._members:
                self._members.remove(member)
            mine = [s for s, (_, owner) in self._records.items() if owner is member]
            self.publish([(s, None) for s in mine])

    def publish(self, changes: list[tuple[Slot, PeerRecord | None]],
                owner: LocalDirectory | None = None, layouts: Mapping[str, dict] | None = None) -> None:
        """Apply `changes` (a record, or None to remove it) held by `owner`, and tell every member."""
        with self._lock:  # held while delivering: every member sees changes in one order
            for slot, record in changes:
                if record is None:
                    self._records.pop(slot, None)
                else:
                    assert owner is not None
                    self._records[slot] = (record, owner)
            for fp, desc in (layouts or {}).items():
                self._layouts.setdefault(fp, desc)
            for member in list(self._members):
                member.receive(changes, layouts)

    def register(self, slot: Slot, record: PeerRecord, owner: LocalDirectory,
                 layouts: Mapping[str, dict] | None, takeover: bool) -> None:
        """`owner` claims `slot` with `record` (`base.claim` decides), in one hold of the lock."""
        with self._lock:
            held = self._records.get(slot)
            claim(slot, None if held is None else held[0], record, takeover)
            self.publish([(slot, record)], owner, layouts)

    def unregister(self, slot: Slot, owner: LocalDirectory) -> None:
        """Remove `slot`'s record if `owner` holds it."""
        with self._lock:
            held = self._records.get(slot)
            if held is not None and held[1] is owner:
                self.publish([(slot, None)])

    def depart(self, slot: Slot) -> None:
        """Remove `slot`'s record as if its holder's lease expired (peers see "down")."""
        with self._lock:
            if slot in self._records:
                self.publish([(slot, None)])

    def expire(self, member: LocalDirectory) -> None:
        """Every record of `member` gone at once: its process's lease expired."""
        with self._lock:
            self.publish([(s, None) for s, (_, owner) in self._records.items() if owner is member])


class LocalDirectory(PeerDirectory):
    """One process's directory on a `LocalHub` (its own if none is given)."""

    def __init__(self, hub: LocalHub | None = None) -> None:
        super().__init__()
        self.hub = LocalHub() if hub is None else hub
        self.hub.join(self)

    def receive(self, changes: list[tuple[Slot, PeerRecord | None]],
                layouts: Mapping[str, dict] | None) -> None:
        """The hub's delivery of `changes` to this member (under the hub's lock)."""
        self._apply(changes, layouts)

    def register(self, slot: Slot, record: PeerRecord, layouts: Mapping[str, dict] | None = None,
                 *, takeover: bool = False) -> None:
        self._check_open()
        check_record(slot, record)
        self.hub.register(slot, record, self, layouts, takeover)

    def unregister(self, slot: Slot) -> None:
        self.hub.unregister(slot, self)

    def health(self) -> DirectoryHealth:
        return DirectoryHealth(not self._closed, 0, 0.0, "closed" if self._closed else "")

    def close(self) -> None:
        if not self._closed:
            super().close()
            self.hub.leave(self)


class StaticDirectory(LocalDirectory):
    """A fixed table of addresses in the directory's shape; register adds to it locally."""

    def __init__(self, records: Mapping[Slot, PeerRecord | str] | None = None) -> None:
        super().__init__()
        table = {slot: PeerRecord(slot, rec, None) if isinstance(rec, str) else rec
                 for slot, rec in (records or {}).items()}
        for slot, record in table.items():
            check_record(slot, record)
        self.hub.publish(list(table.items()), self)

    @classmethod
    def from_groups(cls, model: str, groups: Mapping[str, str | Sequence[str]],
                    role: str = "prefill") -> StaticDirectory:
        """`{instance: "h:p,h:p"}` (TP ranks in order, as `group_address` writes them), DP 1."""
        table: dict[Slot, PeerRecord] = {}
        for instance, group in groups.items():
            addrs = group.split(",") if isinstance(group, str) else list(group)
            if not addrs or not all(isinstance(a, str) and a for a in addrs):
                raise DirectoryError(f"instance {instance!r}: a group is its ranks' addresses in "
                                     f"rank order, got {group!r}")
            for tp, addr in enumerate(addrs):
                slot = Slot(model, role, instance, 0, tp)
                table[slot] = PeerRecord(slot, addr, None, tp_size=len(addrs))
        return cls(table)
