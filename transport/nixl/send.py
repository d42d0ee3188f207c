"""The sending side of one nixl link: the peer's agent and regions, writes as NIXL descriptors.

A `NixlLink` is the kit's `ControlledLink` (`transport.control`): dialed
under one deadline, its `Welcome` carries the metadata of the agent the peer
created for this link alone (why: `inbound.py`), loaded into the engine's
initiating agent. The peer's regions arrive with it as `(region, address,
length, gpu)` rows: a write names a region by its descriptor and the
address comes from this table, so an edited descriptor cannot aim NIXL at
memory the peer never announced.

A write is one NIXL transfer: `plan` turns the checked table into block
indices at its granule (`requests.blocks`: plain ints for a request's few
rows, array arithmetic beyond; off the lock) — or, when the granule would cut a region into more than `MAX_BLOCKS`
blocks, into both descriptor lists — and `submit` hands it to the progress
thread's queue (`requests.Requests`), which makes the NIXL calls against
the lists prepared once per region and granule. The handle completes when
NIXL reports the write DONE (no notify: its bytes are in the peer's memory)
or when the peer's `Acks` name it (with a notify: after its handler ran),
and fails when the link dies (control socket closed: the peer died, closed
or fenced us) or NIXL reports the transfer broken (`post_refused`).

A region registered by the peer after we connected is unknown here until a
`Refresh` round trip, which a write naming it triggers once (the kit's
`resolve`).

A region the peer deregistered (`Gone`, #19): the reader drops it from the
table under the link lock, and `submit` — under the same lock — refuses a
write naming a region no longer in the table (one already checked, or
waiting for its producer's event, fails with `RegistrationError`). So from
then on only writes already handed to `Requests` can name it; the reader
waits (bounded by `connect_timeout`, on `Requests.settled`'s condition: the
progress thread never waits for it) until each of them ended, DONE or ERR,
and then answers `GoneAck`, the receiver's word that it may let the memory
go. Not answered in time, the receiver fences the link (or, unfenceable,
keeps the region until the link ends: `inbound.py`). The reader reads no
`Acks` meanwhile; they wait in the socket.

Closing under `tls="all"` (the peer cannot fence our cma/rc/cuda_ipc writes,
#25.1): the dead link first drains — the progress thread keeps polling its
requests until each is DONE or ERR on its own (`Requests.drained`) — and
only then says `Bye(quiet=True)`, the receiver's proof that none of them
still writes; then its requests are released and the peer's agent forgotten.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pdxfer.transport.nixl.wire as nixl_wire  # absolute: `from . import` depends on nixl/__init__

from ..control import ControlledLink, ints
from ..copying import coalesce_posted
from ..dial import Dials
from ..errors import PeerLostError, RegistrationError, TransportError
from ..link import LinkContext, Remote
from ..posting import Post
from ..regions import Region
from .agent import MAX_BLOCKS, Initiator
from .requests import Requests, Write, blocks
from .wire import GoneAck, Hello, Regions, gpu_of, mem_type, pack_note

log = logging.getLogger(__name__)

_keys = itertools.count(1)  # what a link's prepared lists are filed under (never reused)


def _table(data: bytes) -> dict[int, Remote]:
    rows = ints(data, 4, "region list")
    return {int(r): Remote(int(n), (int(a), int(g))) for r, a, n, g in rows.tolist()}


class NixlLink(ControlledLink):
    """A link to one peer engine: control socket, the peer's regions, transfers awaiting acks."""

    WIRE = nixl_wire

    def __init__(self, ctx: LinkContext, dials: Dials, address: dict[str, Any],
                 initiator: Initiator, requests: Requests, kick: Callable[[], None]) -> None:
        super().__init__(ctx, dials, address, Hello(ctx.engine_id), "nixl")
        self._initiator = initiator
        self._requests = requests
        self._kick = kick
        self.key = next(_keys)
        try:
            self.agent = initiator.load_metadata(self.welcome.metadata, self.welcome.agent)
            self.peer_regions = _table(self.welcome.regions)
        except BaseException:
            self.sock.close()
            raise
        self.start_reader()

    # -- the kit's hooks --------------------------------------------------------------
    def plan(self, src: Region, dst: Remote, table: np.ndarray) -> Any:
        if not table.shape[0]:
            return None
        table = coalesce_posted(table)
        planned = blocks(table)
        block = planned[0]
        if src.length // block <= MAX_BLOCKS and dst.length // block <= MAX_BLOCKS:
            return planned
        base, dst_gpu = dst.info
        return (descs(src.start, table, 0, gpu_of(src)), descs(base, table, 1, dst_gpu))

    def submit(self, post: Post) -> None:
        note = None if post.notify is None else pack_note(post.seq, post.notify)
        plan = post.table
        if plan is None:
            if note is None:  # nothing to move and nothing to say: done now
                self.acked([post.seq])
                return
            write = Write(self, post.seq, note, ("DRAM", "DRAM"))
        else:
            if post.region not in self.peer_regions:  # `Gone` came after the checks: see above
                raise RegistrationError(
                    f"engine {self.peer} deregistered region {post.region} before write "
                    f"{post.seq} was posted; nothing was written — ask the peer for a fresh descriptor")
            mems = (mem_type(gpu_of(post.src)), mem_type(post.dst.info[1]))
            write = Write(self, post.seq, note, mems, post.src, post.region, post.dst,
                          blocks=plan if len(plan) == 3 else None,
                          descs=plan if len(plan) == 2 else None)
        self._requests.queue(write)
        self._kick()

    def regions(self, msg: Regions) -> None:
        self.agent = self._initiator.load_metadata(msg.metadata, self.agent, count=False)
        self.peer_regions = _table(msg.regions)
        self._initiator.invalidate(self.key)  # lists prepared against the old metadata

    def region_gone(self, region_id: int) -> None:
        """`Gone` (reader thread): no new write names it; answer `GoneAck` once the posted ones ended."""
        super().region_gone(region_id)
        timeout = self.ctx.connect_timeout
        if not self._requests.settled(self.key, region_id, time.monotonic() + timeout):
            log.warning("nixl: writes to region %d of %s were still running %s s after it was "
                        "deregistered; not acknowledging (the receiver fences this link)",
                        region_id, self.peer, timeout)
            return
        with self.send_lock:  # a failure (PeerLostError) ends the reader, which severs the link
            self.WIRE.CONTROL.send(self.sock, GoneAck(region_id))

    def drain(self, deadline: float) -> bool:
        """Every write of this dead link ended on its own (the progress thread polls them): True."""
        return self._requests.drained(self, deadline, self._kick)

    def hang_up_path(self) -> None:
        """Cancel this link's requests and forget the peer's agent (and our lists of it)."""
        with self._initiator.lock:
            self._requests.drop(self)
        self._initiator.forget(self.agent, self.key)

    def post_refused(self, seq: int, error: TransportError) -> None:
        """NIXL would not post write `seq` (progress thread): it fails, and the link if broken."""
        if isinstance(error, PeerLostError):
            self.sever(error)
        else:
            self.refused(seq, error)


def descs(base: int, table: np.ndarray, col: int, gpu: int) -> np.ndarray:
    """NIXL's `(address, length, device)` rows for one side of `table`, by array arithmetic."""
    out = np.zeros((table.shape[0], 3), dtype=np.uint64)
    out[:, 0] = table[:, col] + base
    out[:, 1] = table[:, 2]
    out[:, 2] = max(gpu, 0)  # host rows name device 0, as NIXL's own DRAM descriptors do
    return out
