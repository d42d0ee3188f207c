"""The receiving side of one ucx link: a UCX worker that serves exactly one sender, and its fence.

A `UcxInbound` is the kit's `ControlInbound` (`transport.control`): it reads
the link's control frames on its own thread and gets a UCX worker of its own
from the progress thread when the sender says `Hello` (its address goes back
in the `Welcome`).

Per announced write: every run is checked against the region we registered
— region known, ranges inside it, no two overlapping (vectorised,
`segments.check_ranges`), run indices in order, transfer numbers rising —
before one receive is posted; a bad announce ends the link (the sender
hears why, in the kit's `ErrorMessage`). Then the progress thread posts one `tag_recv` per run straight into
the destination (tag `(transfer, run)`); when every run of a transfer has
landed, its notify goes to this link's delivery thread, which hands it to
the handler through the kit's `deliver` (never after a fence) and then acks
the transfer. A handler that blocks stalls this link's notifies only: the
bytes of this and every other link keep landing.

The fence (`stop_path`, the kit's `cut`): the progress thread retires this
link's worker — never progresses it again, cancels its unmatched receives,
drops its unexpected messages — and only then does `stop_path` return.
Every byte of this link lands inside a progress call on that worker (tcp:
UCX reads the socket into our memory there), so none lands afterwards. The
measured reasons this is the fence and closing an endpoint is not: the
package docstring.

Bounds: at most `MAX_POSTED` runs of a link may be posted and not yet
landed; an announce past that is refused (a sender cannot make us hold
unbounded receive state).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from typing import Any

import numpy as np
import pdxfer.transport.ucx.lib as lib  # absolute: `from . import` depends on ucx/__init__
import pdxfer.transport.ucx.wire as ucx_wire  # absolute: `from . import` depends on ucx/__init__

from ..control import ControlInbound, ints
from ..errors import ClosedError, PeerLostError, ProtocolError, RegistrationError
from ..inbound import InboundTable
from ..listener import Slot
from ..segments import check_notify, check_ranges
from .progress import Batch, Progress
from .wire import Announce, Hello, Posted, Regions, Welcome, region_rows

log = logging.getLogger(__name__)

MAX_POSTED = 1 << 20  # runs posted and not landed, per link
JOIN_TIMEOUT = 2.0


class _Transfer:
    """One announced write: runs announced so far, runs landed, its notify once announced whole."""

    __slots__ = ("announced", "complete", "landed", "notify", "region", "runs")

    def __init__(self, region: int, runs: int) -> None:
        self.region, self.runs = region, runs
        self.announced = self.landed = 0
        self.complete = False
        self.notify: bytes | None = None


class Host:
    """What an inbound link needs of its engine: the progress thread, the UCX context, the regions."""

    def __init__(self, engine_id: str, progress: Progress, context: Any, regions: Any,
                 timeout: float, address: bytes) -> None:
        self.engine_id, self.progress, self.context = engine_id, progress, context
        self.regions, self.timeout = regions, timeout
        self.address = address  # the engine's sending worker's: our UCX's address format


class UcxInbound(ControlInbound):
    """One sender's link into this engine: control thread, its own UCX worker, delivery thread."""

    WIRE = ucx_wire

    def __init__(self, table: InboundTable, sock: socket.socket, where: str, slot: Slot, *,
                 host: Host, serial: int) -> None:
        super().__init__(table, sock, f"ucx link from {where}", slot)
        self.host = host
        self.serial = serial
        self.worker: Any = None  # the progress thread's; None once retired
        self.ep: Any = None  # the worker's endpoint to the sender: receives are posted on it
        self._lock = threading.Lock()  # transfers, posted count (control and progress threads)
        self._transfers: dict[int, _Transfer] = {}
        self._last = 0  # the highest transfer number announced
        self._posted = 0
        self._ready: collections.deque[int] = collections.deque()  # landed, notify not yet delivered
        self._cond = threading.Condition(self._lock)
        self._deliverer: threading.Thread | None = None
        self._failing = False  # a receive failed: the link is being fenced (`_fail`)

    # -- setup (the control thread) -----------------------------------------------------
    def admit(self, hello: Hello) -> Welcome:
        host = self.host
        # before anything is made for it: an address UCX could crash on never reaches UCX
        lib.check_address(hello.worker, hello.worker_sum, host.address, f"the hello of {hello.engine!r}")
        self.identify(hello.engine, f"{hello.engine}#{self.serial}")
        address = host.progress.ask(lambda: self._make_worker(hello.worker), host.timeout,
                                    "creating a UCX worker")
        deliverer = threading.Thread(target=self._deliver_loop, daemon=True,
                                     name=f"ucx-notify {hello.engine}")
        # Started and published under the lock `stop_path` takes after the fence set `dead`:
        # the fence either joins a started thread or finds the link dead here and none starts
        # (it once joined one between its creation and its start: RuntimeError).
        with self._cond:
            if self.dead:
                raise PeerLostError("link fenced during its handshake")
            deliverer.start()
            self._deliverer = deliverer
        return Welcome(host.engine_id, address, lib.address_sum(address),
                       region_rows(host.regions.live()), self.incarnation)

    def _make_worker(self, sender: bytes) -> bytes:
        """A worker for this link (progressed from now on) and its endpoint to the sender's; its address.

        Receives are posted on the endpoint, not the worker: UCXX cancels an
        endpoint's receives when it closes, while a worker's stay posted — and
        keep the worker alive — until they complete.
        """
        # On the progress thread, like `_retire`: a fence racing the handshake retires
        # the worker made here, or finds the link dead and none is made.
        if self.dead:
            raise PeerLostError("link fenced")
        self.worker = lib.worker(self.host.context)
        self.host.progress.adopt(self.worker)
        try:
            self.ep = self.host.progress.own(lib.endpoint(self.worker, sender))
        except PeerLostError as exc:  # the address, not the peer, is what failed: say so to it
            raise ProtocolError(f"no UCX endpoint to the worker address in the hello: {exc}") from exc
        return lib.worker_address(self.worker)

    def regions_reply(self, query: int) -> Regions:
        return Regions(query, region_rows(self.host.regions.live()))

    def add_region(self, region: Any) -> None:
        """Nothing to make per link: UCX needs no registration of ours (its cache is its own)."""

    # -- announces (the control thread) ---------------------------------------------------------
    def on_frame(self, msg: Any) -> bool:
        """An `Announce`: check it, then have its receives posted. Raises to end the link."""
        if not isinstance(msg, Announce):
            return False
        region, runs, complete = self._check(msg)
        if runs.shape[0]:
            # bounded wait for the progress thread, on this link's own thread, no lock held
            self.host.progress.ask(lambda: self._post(msg.transfer, msg.first, region, runs),
                                   self.host.timeout, f"posting receives of transfer {msg.transfer}")
            if complete:
                self.send(Posted(np.array([msg.transfer], dtype="<i8").tobytes()))
        else:
            self._landed(msg.transfer, 0, None)  # notify-only, or an empty last part
        return True

    def _check(self, msg: Announce) -> tuple[Any, np.ndarray, bool]:
        """The region, `[n, 2]` runs of a valid announce part and whether it completes its transfer.

        Raises the error that ends the link if the part is not valid.
        """
        what = f"transfer {msg.transfer} into region {msg.region}"
        region = self.host.regions.get(msg.region)
        if region is None:
            raise RegistrationError(f"engine {self.host.engine_id} has no region {msg.region} "
                                    f"({what}); it was deregistered — ask for a fresh descriptor")
        runs = ints(msg.ranges, 2, what)
        check_notify(msg.notify)  # the sender's limit, held here too: a frame may carry 1 MiB
        with self._lock:
            xfer = self._transfers.get(msg.transfer)
            if xfer is None:
                if msg.transfer <= self._last or msg.transfer >= lib.MAX_SEQ:
                    raise ProtocolError(f"{what}: transfer number not new (last {self._last})")
                if not 0 <= msg.runs <= lib.MAX_RUNS or msg.first != 0:
                    raise ProtocolError(f"{what}: {msg.runs} runs, first part at run {msg.first}")
            elif msg.first != xfer.announced or msg.runs != xfer.runs or msg.region != xfer.region:
                raise ProtocolError(f"{what}: part at run {msg.first} does not continue the "
                                    f"{xfer.runs} runs announced into region {xfer.region}")
            announced = msg.first + runs.shape[0]
            if announced > msg.runs or (msg.notify is not None and announced != msg.runs):
                raise ProtocolError(f"{what}: parts end at run {announced} of {msg.runs}")
            if self._posted + runs.shape[0] > MAX_POSTED:
                raise ProtocolError(f"{what}: more than {MAX_POSTED} runs in flight on one link")
        if runs.shape[0]:
            check_ranges(runs, region.length, what)
        with self._lock:
            if xfer is None:
                xfer = self._transfers[msg.transfer] = _Transfer(msg.region, msg.runs)
                self._last = msg.transfer
            xfer.announced = announced
            xfer.complete = announced == msg.runs
            xfer.notify = msg.notify
            self._posted += runs.shape[0]
            complete = xfer.complete
        return region, runs, complete

    # -- the progress thread ------------------------------------------------------------------------
    def _post(self, seq: int, first: int, region: Any, runs: np.ndarray) -> None:
        w, ep = self.worker, self.ep
        if w is None or self.dead:
            return
        try:
            reqs = [ep.tag_recv(lib.buffer(region, off, n), lib.tag(seq, first + i))
                    for i, (off, n) in enumerate(runs.tolist())]
        except Exception as exc:
            log.warning("%s: %s", self.where, lib.translate(exc, f"posting receives of transfer {seq}"))
            self._fail()
            return
        count = len(reqs)
        self.host.progress.track(
            Batch(w, reqs, lambda error: self._landed(seq, count, error), hold=region))

    def _landed(self, seq: int, count: int, error: Exception | None) -> None:
        """`count` runs of transfer `seq` landed (or failed: the link ends)."""
        if error is not None:
            log.warning("%s: %s", self.where, lib.translate(error, f"receiving transfer {seq}"))
            self._fail()
            return
        with self._lock:
            self._posted -= count
            xfer = self._transfers.get(seq)
            if xfer is None:
                return
            xfer.landed += count
            if not (xfer.complete and xfer.landed == xfer.runs):
                return
            self._ready.append(seq)
            self._cond.notify()

    def _fail(self) -> None:
        # Not the fence itself (this may be the progress thread, which the fence waits for).
        with self._lock:
            if self._failing:
                return  # one thread per link: every receive after the first may fail too
            self._failing = True
        threading.Thread(target=self._fail_link, daemon=True, name=f"ucx-fence {self.sender}").start()

    def _fail_link(self) -> None:
        """A receive failed: fence the link — where it cannot settle by itself, after its sender spoke.

        A receive fails when the sender died, and its control connection then
        ends too, a moment later: that end without a `Bye` is the proof of
        death a link of `tls="all"` needs to settle. Fenced first, the link
        closed that socket before the proof arrived and stayed unproven for
        good (#35.6: 6 of 14 SIGKILLs). So such a link first lets its control
        thread end by itself (EOF, or a live sender's `Bye`), bounded by the
        engine's timeout; a link we fence settles anyway.
        """
        if not self.self_settles:
            self.join(self.host.timeout)
        if not self.dead:
            self.fence()

    # -- delivery (this link's own thread) ------------------------------------------------------------
    def _deliver_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self.dead:
                    self._cond.wait()
                if self.dead:
                    return
                seqs = list(self._ready)
                self._ready.clear()
                notes = [self._transfers.pop(s).notify for s in seqs]
            if not self.deliver(notes):
                return
            self.ack(seqs)

    # -- the fence's core ------------------------------------------------------------------------------
    def stop_path(self) -> None:
        """Retire this link's worker on the progress thread; return once it will never progress again."""
        with self._cond:
            self._cond.notify_all()  # the delivery thread sees `dead` and ends
            deliverer = self._deliverer  # started, or never will be (`admit`)
        progress = self.host.progress
        if progress.on_thread:
            self._retire()
        else:
            try:  # queued behind a worker still being made for this link, if any
                progress.ask(self._retire, self.host.timeout, "retiring a fenced link's worker")
            except ClosedError:
                pass  # the UCX thread has ended: it progresses no worker any more
        if deliverer is not None and deliverer is not threading.current_thread():
            deliverer.join(JOIN_TIMEOUT)

    def _retire(self) -> None:
        w, ep, self.worker, self.ep = self.worker, self.ep, None, None
        if w is None:
            return
        if ep is not None:
            try:  # cancels its unmatched receives; a force close (peer error handling): bounded
                lib.close_endpoint(ep)
            except Exception as exc:
                log.debug("ucx: closing the endpoint of the link from %s: %s", self.sender, exc)
        stuck = self.host.progress.retire(w)
        if stuck:
            log.warning("ucx: the fenced link from %s had %d receive(s) under way; its UCX worker "
                        "stays allocated, never progressed again, until the process exits",
                        self.sender, stuck)
