"""Two engines in one process; bytes move by plain copies.

Loopback is the reference backend: the PD engine and the conformance kit run
on it without sockets, and it shows what a transfer costs when the wire is
free. It is also the smallest backend on the kit (`transport.engine`,
`transport.link`, `transport.inbound`): what is left here is what differs.

A link is a `LoopbackLink` (the sending side, a kit `Link`) plus its
`Arrival` (the same link seen from the target engine, a kit `InboundLink`
admitted into the target's inbound table, so the target's `drop_peer` and
`has_peer` see it like any other). Each link owns one worker thread that
executes its writes in post order: the kit checked them and its post queue
waited out their readiness; the worker copies under the arrival's `guard`,
delivers the notify through the arrival (the kit's delivery rule), and
acknowledges. The target's fence cuts the link and takes the guard, so once
it returns no copy is running and none starts.

Copies: CPU→CPU tables go to `copying.CopyPool` (one per sending engine),
which merges rows adjacent on both sides, moves equal-sized short rows with
one vectorised numpy assignment per batch, and shares big tables between
the worker and a few helper threads (its module docstring has the
measurements); a copy in progress finishes on every thread before the
worker releases the guard, so the fence covers helpers too. Anything
involving CUDA memory goes through `device_copy` (a few batched ops per
table) on the link's own copy stream, its temporaries in the sending
engine's bounded device scratch (`EngineBase.scratches`, one copy at a time
per device); the write completes once that stream's event says those copies
landed (`transport.streams`).

Options: `host` and `connect_timeout` are accepted by contract (a deployment
passes one set to any backend) and unused — there is no socket and connect
never waits. Deliberately absent: `read` (pull) and a cross-process mode —
that is what tcp is for.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from .base import Capabilities
from .copying import CopyPool
from .device_copy import Scratches, copy_rows
from .engine import EngineBase
from .errors import CapabilityError, PeerLostError, TransportError
from .inbound import InboundLink, InboundTable
from .link import Link, LinkContext, Remote
from .posting import Post
from .regions import Region, RegionTable
from .streams import CopyStream, cuda_device

log = logging.getLogger(__name__)
JOIN_TIMEOUT = 10.0  # a copy in flight finishes first

# Live engines of this process by id: what `connect` resolves an address with.
_ENGINES: weakref.WeakValueDictionary[str, LoopbackEngine] = weakref.WeakValueDictionary()


def move(copier: CopyPool, src: Region, dst: Region, table: np.ndarray, ready: Any,
         stream: CopyStream, scratches: Scratches, timeout: float) -> None:
    """Copy a checked table from `src` to `dst`: CPU through the pool, CUDA on the link's stream."""
    if table.shape[0] == 0:
        return
    if src.array is None or dst.array is None:
        # After the producer's event, on this link's copy stream, a few batched
        # ops; returns once exactly those landed (transport.streams).
        device = cuda_device(src.data, dst.data)
        with scratches.lease(device, timeout) as scratch:
            stream.run(device, ready, lambda: copy_rows(src.data, dst.data, table, scratch))
        return
    copier.copy(src.array, dst.array, table)


class Arrival(InboundLink):
    """A loopback link seen from its target engine: what the target fences."""

    def __init__(self, table: InboundTable, link: LoopbackLink, sender: str) -> None:
        super().__init__(table, f"loopback link from {sender}")
        self.link = link

    def cut(self) -> None:
        self.link.sever(PeerLostError(f"loopback link {self.link.ctx.engine_id}->{self.link.peer} "
                                      "was fenced or its target closed"))


class LoopbackLink(Link):
    """A link from one loopback engine to another, with its own ordered worker."""

    def __init__(self, ctx: LinkContext, peer: str, target: RegionTable, inbound: InboundTable,
                 copier: CopyPool, scratches: Scratches) -> None:
        super().__init__(ctx, peer, f"loopback engine {peer}")
        self._target = target
        self._copier = copier
        self._scratches = scratches
        self._cond = threading.Condition(self.lock)
        self._work: collections.deque[Post] = collections.deque()
        self._copies = CopyStream()  # this worker's own CUDA stream(s)
        self.arrival = Arrival(inbound, self, ctx.engine_id)
        self._worker = threading.Thread(target=self._run, daemon=True,
                                        name=f"loopback {ctx.engine_id}->{peer}")
        self.incarnation = uuid.uuid4().hex  # never reused, unlike an object's id
        self.arrival.identify(ctx.engine_id, self.incarnation)
        self._worker.start()

    # -- the kit's hooks -----------------------------------------------------------
    def resolve(self, region_id: int) -> Remote | None:
        region = self._target.get(region_id)
        return None if region is None else Remote(region.length, region)

    def check_pair(self, src: Region, dst: Remote) -> None:
        if src.device == dst.info.device == "cuda" and src.data.device != dst.info.data.device:
            # One copy stream orders one device's work; a peer copy would also
            # run on the other device's current stream (the model's), unordered.
            raise CapabilityError(
                f"loopback copies between two CUDA devices ({src.data.device} -> "
                f"{dst.info.data.device}) are not supported; register both regions on one device")

    def submit(self, post: Post) -> None:
        self._work.append(post)
        self._cond.notify()

    def on_sever(self, error: TransportError) -> None:
        with self._cond:
            self._work.clear()
            self._cond.notify_all()
        self.arrival.ended()  # waits out a copy in progress; the target no longer counts us

    def finish(self) -> None:
        """Join the worker (bounded): close() leaves no thread of ours inside a copy at exit.

        Not from the worker itself: a notify handler may close the engine.
        """
        if threading.current_thread() is not self._worker:
            self._worker.join(JOIN_TIMEOUT)

    # -- the worker ------------------------------------------------------------------
    def _run(self) -> None:
        arrival = self.arrival
        while True:
            with self._cond:
                while not self._work and self.error is None:
                    self._cond.wait()
                if self.error is not None:
                    return
                post = self._work.popleft()
            try:
                with arrival.guard:  # a fence waits out this copy, and none starts after it
                    if arrival.dead or self.error is not None:
                        return
                    move(self._copier, post.src, post.dst.info, post.table, post.ready, self._copies,
                         self._scratches, self.ctx.connect_timeout)
            except Exception as exc:  # a copy failing is a bug or a device fault
                if self.error is not None:  # failing as the link closes: its handles failed with it
                    return
                log.exception("loopback copy failed")
                self.refused(post.seq, TransportError(f"{post.handle.what} failed: {exc}"))
                self.sever(TransportError(f"loopback link broken by a failed copy: {exc}"))
                return
            # The kit's delivery rule: never after the target's fence returned.
            notify, seq = post.notify, post.seq
            # Not kept while the worker waits for the next write: the post holds the target's
            # region, which must die with its `deregister` (#19: nothing kept alive).
            del post
            if not arrival.deliver((notify,)):
                return
            self.acked([seq])


class LoopbackEngine(EngineBase):
    """An engine whose peers are other loopback engines of this process."""

    name = "loopback"
    UNUSED_OPTIONS = frozenset({"host", "connect_timeout"})
    capabilities = Capabilities(
        cuda_memory=True, cuda_zero_copy=True, cross_process=False,
        one_sided=True, notify=True, read=False, listens=False,
    )
    FENCE_OPTION = True

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        connect_timeout: float = 10.0,
        copy_threads: int | None = None,
        fence: bool = True,
    ) -> None:
        """`copy_threads`: threads sharing a big CPU copy (default min(4, cores)).
        `fence=False` makes `drop_peer` refuse and `capabilities.fence` False: a test's
        way to run the engine's no-fence (quarantine) path here."""
        del host  # accepted by contract, unused: no socket
        super().__init__(connect_timeout=connect_timeout, options={"fence": fence})
        self._copier = CopyPool(copy_threads or min(4, os.cpu_count() or 1))
        _ENGINES[self.engine_id] = self

    def open_link(self, address: dict[str, Any]) -> Link:
        peer = _ENGINES.get(address["engine"])
        if peer is None or peer.closed:
            raise PeerLostError(f"no live loopback engine {address['engine']!r} in this process")
        link = LoopbackLink(self.link_context(), peer.engine_id, peer.regions, peer.inbound,
                            self._copier, self.scratches)
        if peer.closed:  # closed while we built it: the arrival was refused or fenced
            link.sever(PeerLostError(f"loopback engine {peer.engine_id} closed"))
        return link

    def release(self) -> None:
        _ENGINES.pop(self.engine_id, None)
        self._copier.close(JOIN_TIMEOUT)
