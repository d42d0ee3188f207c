"""The sending side of a link, once for every backend: the write checks, pending handles, acks, the post queue.

`Link` is the connection base. `write()` is written here and nowhere else:

1. the checks, in one order and with one set of messages, before anything
   exists that could move a byte — the local region is ours and registered
   (`RegionTable.local`), the descriptor addresses this backend and this
   peer (`check_descriptor`, checked once per descriptor dict), the peer
   really has that region at that length (the backend's `resolve`), the
   table is in bounds of both and its destinations disjoint (`check_table`,
   or the planner's `CheckedTable` proof), the notify payload is bytes
   under `MAX_NOTIFY`, and `ready` is a CUDA producer's event or nothing
   (`streams.capture`);
2. a sequence number and a `Handle`, recorded as pending before the post
   (an ack may beat the poster back);
3. the link's ordered `PostQueue` (`transport.posting`), which hands the
   write to the backend's `submit` at once or once its source is ready.

What completes a write is the backend's: `acked(seqs)` when the receiver
says those transfers landed (and their notify ran), `refused(seq, error)`
for one write the backend could not post, `sever(error)` when the link dies
— every pending handle fails with the cause, writes still waiting fail too,
and the engine forgets the link so the next `connect` builds a fresh one.

Nothing here assumes the bytes are *written* by the sender: `submit` may
put a one-sided transfer on the wire (nixl, verbs), stream it (tcp), copy it
(loopback) — or, for a two-sided backend, announce it and send per run once
the receiver posted its receives (the seam #26's `ucx` backend uses: its
`resolve` answers from the receiver's announced regions, its `submit`
queues sends, its acks come from send completions). The post queue and the
pending table are the same for all.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .base import Connection, LocalRegion, TransferHandle
from .errors import CapabilityError, ClosedError, RegistrationError, TransportError, again
from .handles import Handle
from .posting import Post, PostQueue, Readiness
from .regions import Region, RegionTable, check_descriptor
from .segments import as_table, check_notify, check_table
from .streams import capture

# Descriptor dicts remembered per link (a caller minting one per write must not grow it).
_DESCRIPTOR_CACHE = 256


class Remote(NamedTuple):
    """What `resolve` knows of a peer region: its real length, and the backend's own data for it."""

    length: int
    info: Any = None


@dataclass(frozen=True)
class LinkContext:
    """The narrow view of its engine a link gets (never the engine itself).

    `backend` names the descriptors it accepts, `regions` resolves local
    regions, `readiness` runs the post queues' waits, `connect_timeout` is the
    bound on every wait of the link, `forget(link)` drops a dead link from the
    engine's outbound table, `drains` says the link must drain before it hangs
    up (`EngineBase.cut_settles`), `farewell(thread)` hands the engine the
    thread a failed link says its goodbye on, for `close()` to join.
    """

    backend: str
    engine_id: str
    regions: RegionTable
    readiness: Readiness
    connect_timeout: float
    forget: Any  # Callable[[Link], None]
    # The peer cannot stop our writes into its memory (one-sided, no fence): a dying link waits
    # for its operations to end and says so (`control.ControlledLink.drain`, #25.1).
    drains: bool = False
    farewell: Any = None  # Callable[[threading.Thread], None]: the engine joins a dying link's goodbye


class Link(Connection):
    """A sender's link to one peer on the kit; backends implement `resolve`, `submit`, `shut`.

    Optional hooks: `check_pair(src, remote)` (a refusal specific to the
    backend), `on_acked(seq)` (per acknowledged transfer, lock held),
    `on_sever(error)` (the link just died: stop its I/O; no lock held) and
    `finish()` (after close's sever: join threads; idempotent).
    """

    # The receiver's name for this link (`Connection.incarnation`): a backend sets it once its
    # handshake named it (tcp: its link id; loopback: its arrival; control links: the Welcome's).
    incarnation: str | None = None

    def __init__(self, ctx: LinkContext, peer: str, what: str) -> None:
        self.ctx = ctx
        self.peer = peer
        self.what = what  # "tcp engine X at host:port": names the peer in errors
        self.lock = threading.RLock()  # pending, queue, the backend's posting state
        self.error: TransportError | None = None
        self._pending: dict[int, Handle] = {}
        self._seqs = itertools.count(1)
        self._descriptors: dict[int, tuple[Any, ...]] = {}
        # `submit` looked up per post (not bound once): a test may wrap it on the instance
        self.queue = PostQueue(self.lock, lambda post: self.submit(post), self._post_failed,
                               ctx.readiness, ctx.connect_timeout, f"a write to {peer}")

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def dead(self) -> bool:
        return self.error is not None

    # -- the write path ---------------------------------------------------------
    def write(
        self,
        local: LocalRegion,
        remote: dict[str, Any],
        segments: np.ndarray,
        notify: bytes | None = None,
        *,
        ready: Any = None,
    ) -> TransferHandle:
        if self.error is not None:
            raise again(self.error)
        src = self.ctx.regions.local(local)
        region_id, length = self._descriptor(remote)
        dst = self.resolve(region_id)
        if dst is None:
            raise RegistrationError(
                f"engine {self.peer} has no region {region_id} (never registered or "
                "deregistered); ask the peer for a fresh descriptor")
        if dst.length != length:
            raise RegistrationError(
                f"descriptor says region {region_id} has {length} B but it has {dst.length} B; "
                "the descriptor is stale or was edited")
        self.check_pair(src, dst)
        table = as_table(segments)
        nbytes = check_table(table, src.length, dst.length)
        payload = check_notify(notify)
        event = capture(ready, src.data.device)
        plan = self.plan(src, dst, table)  # the backend's arithmetic, off the lock
        with self.lock:
            if self.error is not None:
                raise again(self.error)
            seq = next(self._seqs)
            handle = Handle(nbytes, f"{self.ctx.backend} transfer {seq} to {self.peer}")
            self._pending[seq] = handle  # before the post: the ack may beat us back
            try:
                self.queue.put(Post(seq, handle, src, region_id, dst, plan, payload, event))
            except BaseException:
                self._pending.pop(seq, None)
                raise
        return handle

    def _descriptor(self, remote: Any) -> tuple[int, int]:
        """`check_descriptor`'s answer for `remote`, checked once per descriptor dict.

        Callers pass a peer's descriptors back unchanged on every write. A hit
        needs the very dict it was checked on (held here, so its id cannot be
        recycled) still holding the very objects it was checked with under
        every key the check reads; an edited dict is checked afresh.
        """
        hit = self._descriptors.get(id(remote))
        if (hit is not None and hit[0] is remote and remote.get("region") is hit[1]
                and remote.get("length") is hit[2] and remote.get("backend") is hit[3]
                and remote.get("engine") is hit[4] and "device" in remote):
            return hit[1], hit[2]
        region_id, length = check_descriptor(remote, self.ctx.backend, self.peer)
        if type(remote) is dict:  # a subclass could answer `get` differently
            if len(self._descriptors) >= _DESCRIPTOR_CACHE:
                self._descriptors.clear()
            self._descriptors[id(remote)] = (remote, region_id, length, remote["backend"],
                                             remote["engine"])
        return region_id, length

    # -- backend hooks --------------------------------------------------------------
    def resolve(self, region_id: int) -> Remote | None:
        """The peer's region `region_id` (None: it has none). May wait, bounded; no lock held."""
        raise NotImplementedError

    def plan(self, src: Region, dst: Remote, table: np.ndarray) -> Any:
        """The backend's form of a checked table (stripes, descriptors, WRs): `post.table`. No lock held."""
        return table

    def submit(self, post: Post) -> None:
        """Hand one write to the backend's I/O, in order; never blocks. Link lock held."""
        raise NotImplementedError

    def check_pair(self, src: Region, dst: Remote) -> None:
        """Refuse a source/destination pair this backend cannot move (default: any is fine)."""

    def on_acked(self, seq: int) -> None:
        """Transfer `seq` was acknowledged (link lock held)."""

    def on_sever(self, error: TransportError) -> None:
        """The link just died with `error`: stop its I/O (wake threads, release resources)."""

    def finish(self) -> None:
        """After close's sever: join the link's threads, release what is left. Idempotent."""

    # -- completion -----------------------------------------------------------------
    def acked(self, seqs: list[int]) -> int:
        """Complete the transfers the receiver confirmed; the number of seqs it named we never sent."""
        unknown = 0
        with self.lock:
            done = []
            for seq in seqs:
                handle = self._pending.pop(seq, None)
                if handle is None:
                    unknown += 1
                    continue
                self.on_acked(seq)
                done.append(handle)
        for handle in done:
            handle.complete()
        return unknown

    def refused(self, seq: int, error: TransportError) -> None:
        """Fail write `seq` alone (the backend could not post it); the link stays."""
        with self.lock:
            handle = self._pending.pop(seq, None)
        if handle is not None:
            handle.fail(error)

    def _post_failed(self, post: Post, error: TransportError) -> None:
        self.refused(post.seq, error)

    def pending(self) -> int:
        """Transfers posted and not yet confirmed."""
        return len(self._pending)

    # -- death ------------------------------------------------------------------------
    def sever(self, error: TransportError) -> bool:
        """Kill the link with `error` once: every pending handle fails with it. False if already dead."""
        with self.lock:
            if self.error is not None:
                return False
            self.error = error
            pending = list(self._pending.values())
            self._pending.clear()
            self.queue.stop(error)
        for handle in pending:
            handle.fail(error)
        self.on_sever(error)
        self.ctx.forget(self)
        return True

    def close(self) -> None:
        """Fail whatever is in flight with `ClosedError` and release the link. Idempotent."""
        self.sever(ClosedError(f"{self.ctx.backend} connection {self.ctx.engine_id}->{self.peer} closed"))
        self.finish()

    def read(self, local: LocalRegion, remote: dict[str, Any], segments: np.ndarray) -> TransferHandle:
        raise CapabilityError(f"{type(self).__name__} does not support read; use write")
