"""The sending side of one ucx link: announce each write's runs, then one tag send per run.

A `UcxLink` is the kit's `ControlledLink` (`transport.control`): dialed
under one deadline; its `Welcome` carries the UCX address of the worker the
peer created for this link alone (why: the package docstring) and the
peer's regions as `(region, length)` rows, which `resolve` answers from.

A write: `plan` coalesces the checked table (rows contiguous on both sides
merge into one run; off the lock) and refuses more than `lib.MAX_RUNS`
runs; `submit` hands the announce frames to this link's control writer
thread and keeps the write until the peer says `Posted` — neither blocks
the caller, so a stalled peer (full socket, no answer) stalls only this
link. Then the progress thread posts one `tag_send` per run straight from
the registered source (tag `(transfer, run)`: every receive is waiting for
it, so UCX buffers nothing), and the handle completes when the peer's
`Acks` name the transfer: after every run landed and its notify ran. A send
UCX fails (the peer's worker gone, the endpoint closed) severs the link
with the translated error.

Closing: the kit's `finish` says `Bye` and hangs up; `hang_up_path` then
force-closes the endpoint on the progress thread, which ends (fails) every
send still in flight, so none outlives the link. Under `tls="all"` the
peer cannot stop what UCX moves for us (cuda_ipc, rc: no fence), so first
the link drains (#25.1): every tag send it posted must complete on its own
— a completed send's bytes are in the peer's memory — before it says
`Bye(quiet=True)`; a send force-closed mid-way proves nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np
import pdxfer.transport.ucx.lib as lib  # absolute: `from . import` depends on ucx/__init__
import pdxfer.transport.ucx.wire as ucx_wire  # absolute: `from . import` depends on ucx/__init__

from ..control import ControlledLink, ints
from ..copying import coalesce_posted
from ..dial import Dials
from ..errors import BoundsError, PeerLostError, ProtocolError, TransportError
from ..link import LinkContext, Remote
from ..posting import Post
from ..regions import Region
from .progress import Batch, Progress
from .wire import CONTROL, Hello, Posted, Regions, announce

log = logging.getLogger(__name__)
JOIN_TIMEOUT = 2.0
DRAIN_POLL = 0.002  # longest pause between two looks at a draining link's sends (s)


def _table(data: bytes) -> dict[int, Remote]:
    return {int(r): Remote(int(n)) for r, n in ints(data, 2, "region list").tolist()}


class UcxLink(ControlledLink):
    """A link to one peer engine: control socket, its writer, the endpoint to the peer's link worker."""

    WIRE = ucx_wire

    def __init__(self, ctx: LinkContext, dials: Dials, address: dict[str, Any], progress: Progress,
                 worker: Any, worker_address: bytes) -> None:
        super().__init__(ctx, dials, address,
                         Hello(ctx.engine_id, worker_address, lib.address_sum(worker_address)), "ucx")
        self._progress = progress
        self._worker = worker  # the engine's sending worker (progress thread only)
        self._ep: Any = None
        self._frames: collections.deque[bytes] = collections.deque()
        self._announced: dict[int, Post] = {}  # writes waiting for the peer's `Posted` (link lock)
        self._sending: list[Any] = []  # tag sends not yet seen complete (progress thread; ctx.drains)
        self._cond = threading.Condition()
        try:
            # on the dialing thread: an address UCX could crash on fails this connect, unparsed
            lib.check_address(self.welcome.worker, self.welcome.worker_sum, worker_address,
                              f"the welcome of {self.what}")
            self.peer_regions = _table(self.welcome.regions)
            progress.call(self._open)
        except BaseException:
            self.sock.close()
            raise
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"ucx-announce {self.peer}")
        self._writer.start()
        self.start_reader()

    # -- the kit's hooks --------------------------------------------------------------
    def plan(self, src: Region, dst: Remote, table: np.ndarray) -> np.ndarray:
        runs = coalesce_posted(table) if table.shape[0] else table
        if runs.shape[0] > lib.MAX_RUNS:
            raise BoundsError(
                f"a ucx write moves at most {lib.MAX_RUNS} runs (rows left after merging those "
                f"contiguous on both sides); this table has {runs.shape[0]}: split it into several writes")
        return runs

    def submit(self, post: Post) -> None:
        if post.seq >= lib.MAX_SEQ:
            raise PeerLostError(f"{self.what}: transfer numbers exhausted; reconnect")
        frames = [CONTROL.pack(f) for f in announce(post.seq, post.region, post.table[:, 1:],
                                                      post.notify)]
        if post.table.shape[0]:
            self._announced[post.seq] = post
        with self._cond:
            self._frames.extend(frames)
            self._cond.notify()

    def on_frame(self, msg: Any) -> bool:
        """`Posted`: the peer's receives for these writes wait; send their runs (reader thread)."""
        if not isinstance(msg, Posted):
            return False
        seqs = ints(msg.seqs, 1, "posted")[:, 0].tolist()
        with self.lock:
            posts = [self._announced.pop(seq, None) for seq in seqs]
        if any(p is None for p in posts):
            raise ProtocolError(f"{self.what} says it posted receives of a write it was never sent")
        self._progress.call(lambda: [self._send(p) for p in posts])
        return True

    def regions(self, msg: Regions) -> None:
        self.peer_regions = _table(msg.regions)

    def on_sever(self, error: TransportError) -> None:
        with self.lock:
            self._announced.clear()
        super().on_sever(error)

    def hang_up_path(self) -> None:
        with self._cond:
            self._frames.clear()
            self._cond.notify_all()
        try:
            self._progress.call(self._close)
        except TransportError:
            pass  # the engine's progress thread is gone: it closed every endpoint itself

    def drain(self, deadline: float) -> bool:
        """Every tag send this link posted has completed on its own (asked on the UCX thread)."""
        pause = 0.0
        while True:
            left = deadline - time.monotonic()
            try:
                if self._progress.ask(self._settled, max(left, 0.001), "draining a link's sends"):
                    return True
            except TransportError:  # the UCX thread is gone or slow: nothing proven
                return False
            if left <= 0:
                return False
            pause = min(DRAIN_POLL, pause * 2 + 2e-5)
            time.sleep(pause)

    def _settled(self) -> bool:
        self._sending = [req for req in self._sending if not req.completed]
        return not self._sending

    def finish(self) -> None:
        super().finish()
        if self._writer is not threading.current_thread():
            self._writer.join(JOIN_TIMEOUT)

    # -- the progress thread --------------------------------------------------------------
    def _open(self) -> None:
        if self.error is not None:
            return
        try:
            self._ep = self._progress.own(lib.endpoint(self._worker, self.welcome.worker))
        except TransportError as exc:
            self.sever(exc)

    def _send(self, post: Post) -> None:
        ep = self._ep
        if ep is None or self.error is not None:
            return  # the link died before this write got out; its handle already failed
        src, seq = post.src, post.seq
        try:
            reqs = [ep.tag_send(lib.buffer(src, int(off), int(n)), lib.tag(seq, i))
                    for i, (off, n) in enumerate(post.table[:, ::2].tolist())]
        except Exception as exc:
            self.sever(lib.translate(exc, f"posting transfer {seq} to {self.what}"))
            return
        if self.ctx.drains:
            self._settled()  # forget what completed, so the list holds what is in flight
            self._sending += reqs
        self._progress.track(Batch(self._worker, reqs, lambda error: self._sent(seq, error), hold=src))

    def _sent(self, seq: int, error: Exception | None) -> None:
        if error is not None and self.error is None:
            self.sever(lib.translate(error, f"sending transfer {seq} to {self.what}"))

    def _close(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                lib.close_endpoint(ep)  # fails the sends still in flight
            except Exception as exc:
                log.debug("ucx: closing the endpoint to %s: %s", self.what, exc)

    # -- the control writer ------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._frames and self.error is None:
                    self._cond.wait()
                if self.error is not None:
                    return
                frames = list(self._frames)
                self._frames.clear()
            try:
                with self.send_lock:
                    self.sock.sendall(b"".join(frames))
            except OSError as exc:
                self.sever(PeerLostError(f"announcing to {self.what} failed: {exc}"))
                return
