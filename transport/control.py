"""The control channel a one-sided backend keeps beside its data path, written once on the kit.

A backend whose bytes move without the receiver's CPU (nixl, verbs) still
needs a small TCP conversation per link: the receiver announces its regions
(its `Welcome`, and `Regions` in answer to a `Refresh` when a write names a
region the sender does not know), says when one is `Gone`, acknowledges
landed transfers (`Acks`), and the sender says `Bye` before it closes. A
closed control socket is also how a dead peer is noticed at once. The shape
of all that is the same for every such backend; only the frame classes and
what a region entry means differ.

Two kit classes carry it:

* `ControlledLink` (a `link.Link`): dials the peer under one deadline
  (`transport.dial`), keeps the peer's region table (`resolve` answers from
  it, refreshing once for an unknown region), runs the control reader
  (acks complete handles through the kit's `acked`, `Gone` drops a region,
  anything else severs), and on close says `Bye` and waits (bounded) for the
  peer to fence it and hang up. A backend implements `table(msg)` (its
  region rows), `regions(msg)` (install a `Regions` answer), and
  `hang_up_path()` (free the data path: QPs, a peer's agent). Where the
  sender writes into the peer's memory and the peer cannot stop it (an
  engine whose `capabilities.fence` is False: `LinkContext.drains`), the
  link first waits (bounded) until every operation it posted has ended —
  the backend's `drain` — and says so in its `Bye(quiet=True)`: the only
  proof such a receiver has that nothing of the link can still land
  (#25.1). It says `Bye` before hanging up on every path it can, a failure
  too (then from a short-lived thread, since the drain may need the thread
  that failed it), so a control connection that ends without one means
  the sender died.
* `ControlInbound` (an `inbound.InboundLink`): serves one accepted control
  socket — the capped hello (`listener.read_hello`), the backend's `admit`
  (build its side of the link, call `identify`, return the `Welcome`, which
  names the link's incarnation), then `Refresh` and `Bye` until the link
  ends, when it fences itself. What ended it decides whether it settles
  (`inbound`): a `Bye(quiet=True)`, or the sender's side closing without
  any `Bye`, is the proof a link that cannot settle by itself needs. Sends (acks, `Gone`,
  replies) that fail fence the link: a sender that stopped reading is gone.
  A send that finds the sender's side hung up (reset, broken pipe) fences
  only once the link's reader has read that end, bounded by `SEND_TIMEOUT`:
  the reader's end without a `Bye` is the proof; fenced first, the socket
  was closed under the reader and a link that cannot settle by itself
  stayed unproven for good.
  `hand_over(landed)` is the progress thread's one way to pass notes on:
  the kit's delivery rule, then one `Acks` frame. With `block=False` (a
  progress thread serving many links) the frame goes out only as far as the
  socket takes it without waiting (`ack_nowait`); the rest waits in the
  link (bounded: a sender has at most its credits of transfers
  unacknowledged) and goes on the next `flush_acks`, so one sender that
  stopped reading, or a reply being sent to it, never holds up the thread
  that serves every other link. A sender that takes none of it for
  `SEND_TIMEOUT` is fenced.
* `LinkRegions`: every inbound control link is given every live region
  (nixl registers it on the link's agent, verbs makes the link's MR), and
  told `Gone` when one is deregistered. No lock is held while a link
  registers (pinning may take seconds); see its docstring for why none is
  needed.

`WIRE` is a module holding the backend's `CONTROL` protocol and its frame
classes (`Hello`, `Welcome`, `Regions`) beside the shared ones below.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from .closing import BYE_WAIT
from .dial import Dials, dial
from .errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    TransferTimeout,
    TransportError,
    again,
)
from .inbound import InboundLink, InboundTable
from .link import Link, LinkContext, Remote
from .listener import Slot, read_hello
from .regions import Region, RegionTable
from .wire import ErrorMessage

log = logging.getLogger(__name__)
# A stalled sender that stops reading its control socket must not stall our
# progress thread forever in a send of acks.
SEND_TIMEOUT = 5.0


def _hung_up(exc: BaseException) -> bool:
    """Whether a failed send says the other side closed or reset the connection (not a stall)."""
    # the socket's own error, or the one our wire's PeerLostError was raised from
    return any(isinstance(e, ConnectionResetError | BrokenPipeError) for e in (exc, exc.__cause__))


# The frames whose meaning is the same on every control channel; each backend's
# wire module lists them in its own versioned `Protocol` beside its own.
@dataclass(frozen=True)
class Refresh:
    """A write named a region the sender does not know: send the current table."""

    TYPE: ClassVar[str] = "refresh"
    query: int


@dataclass(frozen=True)
class Acks:
    """These transfers' bytes are in the receiver's memory and their notify was delivered."""

    TYPE: ClassVar[str] = "acks"
    seqs: bytes  # little-endian int64 sequence numbers


@dataclass(frozen=True)
class Gone:
    """Region `region` was deregistered: stop addressing it."""

    TYPE: ClassVar[str] = "gone"
    region: int


@dataclass(frozen=True)
class Bye:
    """The sender closes the link; the receiver fences it and hangs up.

    `quiet`: every operation the sender posted on this link has ended (completed,
    failed or flushed on its side): nothing of it can still write into the
    receiver. False when the sender could not drain them within its bound.
    """

    TYPE: ClassVar[str] = "bye"
    quiet: bool


def ints(data: bytes, width: int, what: str) -> np.ndarray:
    """Raw little-endian int64 bytes as an `[n, width]` array (`ProtocolError` if ragged)."""
    if len(data) % (8 * width):
        raise ProtocolError(f"{what}: {len(data)} B is not a whole number of {width}-int rows")
    return np.frombuffer(data, dtype="<i8").reshape(-1, width).astype(np.int64)


def seqs_of(msg: Acks) -> list[int]:
    """The sequence numbers an `Acks` frame names (`ProtocolError` if ragged)."""
    if len(msg.seqs) % 8:
        raise ProtocolError(f"acks of {len(msg.seqs)} B are not whole int64s")
    return np.frombuffer(msg.seqs, dtype="<i8").tolist()


class ControlledLink(Link):
    """A sender's link with a control socket: dial, the peer's regions, acks, `Bye` on close."""

    WIRE: ClassVar[ModuleType]

    def __init__(self, ctx: LinkContext, dials: Dials, address: dict[str, Any], hello: Any,
                 backend: str) -> None:
        host, port, peer = address["host"], address["port"], address["engine"]
        super().__init__(ctx, peer, f"{backend} engine {peer} at {host}:{port}")
        self._qids = itertools.count(1)
        self._queries: dict[int, threading.Event] = {}
        self._hung_up = False
        self._reader: threading.Thread | None = None
        self._farewell: threading.Thread | None = None  # drain + Bye after a failure (ctx.drains)
        self.send_lock = threading.Lock()  # one frame at a time: callers' refreshes, Bye, a backend's own
        self.peer_regions: dict[int, Any] = {}
        self.sock, self.welcome = dial(dials, host, port, self.WIRE.CONTROL, hello,
                                       timeout=ctx.connect_timeout, peer=peer, what=self.what)
        if not isinstance(self.welcome, self.WIRE.Welcome):
            self.sock.close()
            raise ProtocolError(f"expected welcome from {self.what}, got {type(self.welcome).TYPE}")
        self.incarnation = self.welcome.link  # the receiver's name for this link

    def start_reader(self) -> None:
        """Start the control reader (once the backend finished setting the link up)."""
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"{self.ctx.backend}-out {self.peer}")
        self._reader.start()

    # -- backend hooks ------------------------------------------------------------
    def regions(self, msg: Any) -> None:
        """Install the region table of a `Regions` answer (reader thread)."""
        raise NotImplementedError

    def hang_up_path(self) -> None:
        """Free the data path's resources as the link dies (once)."""

    def on_frame(self, msg: Any) -> bool:
        """A frame of the backend's own (ucx's `Posted`); False if it is not one. Raises to sever."""
        return False

    def region_gone(self, region_id: int) -> None:
        """The peer deregistered `region_id` (reader thread): forget it, under the link lock.

        Under the lock `submit` runs under, so a write whose `submit` comes
        after this can check the table and see the region gone (nixl's
        `GoneAck` counts on it). A backend that must say when nothing of it
        still writes there extends this.
        """
        with self.lock:
            self.peer_regions = {k: v for k, v in self.peer_regions.items() if k != region_id}

    def drain(self, deadline: float) -> bool:
        """After the link died: wait (until `deadline`, monotonic) until no operation it posted can
        still write into the peer; True if none can. Called only when `ctx.drains`.

        Never on a thread the drain needs (the kit calls it from close's caller or
        its own farewell thread). Default: nothing to wait for.
        """
        del deadline
        return True

    # -- the kit's hooks --------------------------------------------------------------
    def resolve(self, region_id: int) -> Remote | None:
        found = self.peer_regions.get(region_id)
        if found is None:
            self._refresh()
            found = self.peer_regions.get(region_id)
        return found

    def on_sever(self, error: TransportError) -> None:
        with self.lock:
            queries = list(self._queries.values())
        for done in queries:
            done.set()
        if isinstance(error, ClosedError):
            return  # close() goes on with `finish`
        if not self.ctx.drains:
            self._hang_up()
            return
        # The peer cannot stop our writes: drain them and say so before hanging up. Not on this
        # thread, which may be the one the drain needs (a progress thread that saw the error).
        with self.lock:
            if self._farewell is not None or self._hung_up:
                return
            self._farewell = threading.Thread(target=self._say_farewell, daemon=True,
                                              name=f"{self.ctx.backend}-bye {self.peer}")
            self._farewell.start()  # under the lock: `finish` never sees it unstarted
        if self.ctx.farewell is not None:
            self.ctx.farewell(self._farewell)  # the engine's close joins it

    def finish(self) -> None:
        """Close's second half: drain (if we must), say `Bye`, let the peer fence us (bounded), hang up."""
        farewell = self._farewell
        if farewell is not None:  # a failure already started the goodbye: let it end (bounded)
            if farewell is not threading.current_thread():
                farewell.join(self.ctx.connect_timeout + BYE_WAIT)
            return
        if self._hung_up:
            return
        self._bye()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(BYE_WAIT)  # the peer fences us on Bye and hangs up; that ends our reader
        self._hang_up()

    def _say_farewell(self) -> None:
        self._bye()
        self._hang_up()

    def _bye(self) -> None:
        """Say `Bye`, quiet if nothing we posted can still write into the peer (drained when we must)."""
        quiet = True
        if self.ctx.drains:
            try:
                quiet = self.drain(time.monotonic() + self.ctx.connect_timeout)
            except Exception:  # a backend failure while draining: say what we know, never hang
                log.exception("%s: draining the link to %s failed", self.ctx.backend, self.peer)
                quiet = False
            if not quiet:
                log.warning("%s: operations posted to %s were still running %s s after the link "
                            "died; its receiver cannot count on them having stopped", self.ctx.backend,
                            self.peer, self.ctx.connect_timeout)
        try:
            with self.send_lock:
                self.WIRE.CONTROL.send(self.sock, Bye(quiet))
        except (TransportError, OSError):
            pass

    # -- the control conversation --------------------------------------------------------
    def _refresh(self) -> None:
        query, done = next(self._qids), threading.Event()
        with self.lock:
            if self.error is not None:
                raise again(self.error)
            self._queries[query] = done
        try:
            with self.send_lock:
                self.WIRE.CONTROL.send(self.sock, Refresh(query))
            timeout = self.ctx.connect_timeout
            if not done.wait(timeout):
                raise TransferTimeout(
                    f"{self.what} did not answer a region refresh in {timeout} s; "
                    "it is stalled — drop it or retry")
        finally:
            with self.lock:
                self._queries.pop(query, None)
        if self.error is not None:
            raise again(self.error)

    def _read(self) -> None:
        w = self.WIRE
        try:
            while True:
                msg = w.CONTROL.recv(self.sock)
                if isinstance(msg, Acks):
                    self.acked(seqs_of(msg))  # an ack for a write refused meanwhile is harmless
                elif isinstance(msg, w.Regions):
                    self.regions(msg)
                    with self.lock:
                        done = self._queries.get(msg.query)
                    if done is not None:
                        done.set()
                elif isinstance(msg, Gone):
                    self.region_gone(msg.region)
                elif self.on_frame(msg):
                    pass
                elif isinstance(msg, ErrorMessage):
                    raise ProtocolError(f"{self.what} hung up: {msg.reason}")
                else:
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from {self.what}")
        except PeerLostError as exc:
            self.sever(PeerLostError(
                f"{self.what} closed the link (it died, closed, or dropped us): {exc}"))
        except TransportError as exc:
            self.sever(exc)
        except Exception as exc:  # a bug of ours or the backend's: never leave the link alive but deaf
            log.exception("%s: the control reader of the link to %s failed", self.ctx.backend,
                          self.peer)
            error = TransportError(f"the control reader of the link to {self.what} failed "
                                   f"({type(exc).__name__}: {exc}); the link is severed")
            error.__cause__ = exc
            self.sever(error)

    def _hang_up(self) -> None:
        with self.lock:
            if self._hung_up:
                return
            self._hung_up = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.hang_up_path()


class ControlInbound(InboundLink):
    """One accepted control socket: hello, the backend's admission, then `Refresh`/`Bye` until it ends."""

    WIRE: ClassVar[ModuleType]

    def __init__(self, table: InboundTable, sock: socket.socket, where: str, slot: Slot) -> None:
        super().__init__(table, f"{where}")
        self.sock = sock
        self.slot = slot  # our place in the listener's pre-handshake budget
        self.send_lock = threading.Lock()
        self._ack_lock = threading.Lock()
        self._acks: list[int] = []  # acked seqs not framed yet (ack_nowait)
        self._unsent = b""  # the part of an ack frame the socket has not taken yet
        self._stuck_since = 0.0  # when the socket last refused to take any of it
        # A `Gone` for a link identified but not welcomed yet waits for the `Welcome`: the
        # sender's dial reads exactly one frame, the Welcome, and any other first frame fails it.
        self._welcomed = False
        self._early: list[Any] = []
        # Set (in `cut`) just before we shut the socket down ourselves: an end of stream read
        # before it is the sender's, whether or not a fence of ours is already under way.
        self._cut_here = False
        self._ending = False  # a send found the sender hung up: the reader concludes (`_send_failed`)

    # -- backend hooks ------------------------------------------------------------
    def admit(self, hello: Any) -> Any:
        """Build this side of the link for `hello`'s sender (call `identify`); its `Welcome`."""
        raise NotImplementedError

    def regions_reply(self, query: int) -> Any:
        """The `Regions` answer to a `Refresh`."""
        raise NotImplementedError

    def stop_path(self) -> None:
        """Stop the data path: return once no byte of this link can land (the fence's core)."""

    def on_frame(self, msg: Any) -> bool:
        """A frame of the backend's own (ucx's announces); False if it is not one. Raises to end the link."""
        return False

    def add_region(self, region: Region) -> None:
        """Give this link's sender `region` (its registration on the link's data path)."""
        raise NotImplementedError

    def region_gone(self, region_id: int) -> None:
        """Region `region_id` was deregistered (its registrations closed): tell the sender."""
        self.send(Gone(region_id))

    def gone_settled(self, region_id: int, deadline: float) -> None:
        """After `region_gone`: return (by `deadline`, monotonic) once this link keeps nothing of the
        region alive. Default: nothing is kept. No lock held by the caller.
        """
        del region_id, deadline

    # -- the link's thread ----------------------------------------------------------------
    def run(self) -> None:
        w = self.WIRE
        try:
            hello = read_hello(self.sock, w.CONTROL, w.Hello)
            welcome = self.admit(hello)
            # The reader blocks until the peer talks or hangs up; sends (acks, from a
            # progress thread) give up after SEND_TIMEOUT instead.
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                 struct.pack("ll", int(SEND_TIMEOUT), 0))
            self._send(welcome)
            with self.send_lock:
                self._welcomed = True
                early, self._early = self._early, []
            for msg in early:  # a deregistration that raced the handshake
                self.send(msg)
            self.slot.admitted()
            while not self.dead:
                msg = w.CONTROL.recv(self.sock)
                if isinstance(msg, Refresh):
                    # Made under the send lock: a `Gone` for a region the reply lists goes
                    # after it, never before (`send_made`).
                    self.send_made(lambda msg=msg: self.regions_reply(msg.query))
                elif isinstance(msg, Bye):
                    self.quiet_said = msg.quiet  # the sender's word that nothing of it still writes
                    break
                elif not self.on_frame(msg):
                    raise ProtocolError(f"unexpected {type(msg).TYPE} from sender {self.sender}")
        except (TransportError, OSError) as exc:
            if isinstance(exc, PeerLostError) and not self._cut_here and self.sender is not None:
                # Its side closed without a Bye, which our senders never do while alive: it died.
                # Taken even when a fence of ours began first (a receive that failed as the sender
                # died, #35.6): the proof does not depend on which of the two we saw first.
                self.peer_gone = True
            if not self.dead and not isinstance(exc, PeerLostError):
                log.warning("%s link from %s (%s) dropped: %s", self.table.name, self.sender,
                            self.where, exc)
                try:
                    self._send(ErrorMessage(reason=str(exc)))
                except (TransportError, OSError):
                    pass
        except Exception:  # a backend failure while admitting: the link is unusable
            log.exception("%s link from %s (%s) failed", self.table.name, self.sender, self.where)
        self.slot.admitted()
        self.fence()

    # -- what the receiver says ------------------------------------------------------------
    def hand_over(self, landed: list[tuple[int, bytes | None]], *, block: bool = True) -> None:
        """Deliver landed transfers' notifies (the kit's rule), then acknowledge them in one frame.

        `block=False`: the ack never waits on the socket (`ack_nowait`); the
        caller then calls `flush_acks` on later rounds while `unacked`.
        """
        if self.deliver(payload for _, payload in landed):
            seqs = [seq for seq, _ in landed]
            if block:
                self.ack(seqs)
            else:
                self.ack_nowait(seqs)

    def ack(self, seqs: list[int]) -> None:
        """Tell the sender these transfers landed (after their notify was delivered)."""
        if seqs:
            self.send(Acks(np.asarray(seqs, dtype="<i8").tobytes()))

    def send(self, msg: Any) -> None:
        """Best effort: a send that fails means the sender is gone, and the link is fenced.

        A `Gone` before the link's `Welcome` went out is held and sent right after it.
        """
        if self.dead:
            return
        if isinstance(msg, Gone):
            with self.send_lock:
                if not self._welcomed:
                    self._early.append(msg)
                    return
        try:
            self._send(msg)
        except (TransportError, OSError) as exc:
            self._send_failed(type(msg).TYPE, exc)

    def _send_failed(self, what: str, exc: BaseException) -> None:
        """A send to the sender failed: fence the link — after its reader saw the end, if it hung up.

        A sender that hung up (it died: reset, broken pipe) ends the reader's
        stream too, at once; read there without a `Bye`, that end is the proof
        a link that cannot settle by itself needs (`peer_gone`). Fenced here
        first, the link closed the socket under the reader, which then read
        our own cut: unproven for good (ucx `tls="all"`, 1 of 12 SIGKILLed
        senders). So such a link waits (off this thread, which may be the
        progress thread) for its reader to end, bounded by `SEND_TIMEOUT`,
        and is fenced then if it still lives. A stalled sender (a send timing
        out) is fenced at once.
        """
        log.warning("%s: link from %s lost while sending %s: %s", self.table.name, self.sender, what, exc)
        if self.self_settles or not _hung_up(exc):
            self.fence()
            return
        with self._ack_lock:
            if self._ending:
                return
            self._ending = True
        threading.Thread(target=self._end_after_reader, daemon=True,
                         name=f"control-end {self.sender}").start()

    def _end_after_reader(self) -> None:
        self.join(SEND_TIMEOUT)
        if not self.dead:
            self.fence()

    def ack_nowait(self, seqs: list[int]) -> None:
        """`ack`, for a progress thread: never waits on the socket or on another sender (see above)."""
        if seqs:
            with self._ack_lock:
                self._acks.extend(seqs)
        self.flush_acks()

    @property
    def unacked(self) -> bool:
        """Acks are waiting for the socket (call `flush_acks` again)."""
        return bool(self._acks or self._unsent)

    def flush_acks(self) -> None:
        """Push waiting acks as far as the socket takes them now; fence a sender stuck for SEND_TIMEOUT."""
        if self.dead or not self.send_lock.acquire(blocking=False):
            return  # a reply is being sent: the next call pushes
        error: BaseException | None = None
        try:
            while True:
                if not self._unsent:
                    with self._ack_lock:
                        seqs, self._acks = self._acks, []
                    if not seqs:
                        break
                    self._unsent = self.WIRE.CONTROL.pack(Acks(np.asarray(seqs, dtype="<i8").tobytes()))
                try:
                    taken = self.sock.send(self._unsent, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    taken = 0
                self._unsent = self._unsent[taken:]
                if self._unsent:
                    now = time.monotonic()
                    if taken or not self._stuck_since:
                        self._stuck_since = now
                    elif now - self._stuck_since > SEND_TIMEOUT:
                        error = TransferTimeout(f"the sender took no acks for {SEND_TIMEOUT} s")
                    break
                self._stuck_since = 0.0
        except OSError as exc:
            error = exc
        finally:
            self.send_lock.release()
        if error is not None:
            self._send_failed("acks", error)

    def send_made(self, make: Callable[[], Any]) -> None:
        """Send the frame `make()` returns, made under the send lock (a reply listing regions).

        So a frame a deregistration sends after it (`Gone`) cannot overtake
        one made from the region table before the region left it: a sender
        never reinstalls a region it was told is gone.
        """
        self._send(None, make)

    def _send(self, msg: Any, make: Callable[[], Any] | None = None) -> None:
        with self.send_lock:
            if make is not None:
                msg = make()
            # Acks queued before this reply go ahead of it, whole: frames never interleave, and
            # none is left behind for a `flush_acks` that may not come (a reply that left acks
            # queued once stalled a sender that had nothing more to send).
            with self._ack_lock:
                seqs, self._acks = self._acks, []
            if seqs:
                self._unsent += self.WIRE.CONTROL.pack(Acks(np.asarray(seqs, dtype="<i8").tobytes()))
            if self._unsent:
                self.sock.sendall(self._unsent)
                self._unsent = b""
            self.WIRE.CONTROL.send(self.sock, msg)

    def cut(self) -> None:
        try:
            self.stop_path()
            self._cut_here = True
        finally:  # the control socket goes even if the data path's stop raised (#29 item 4)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class LinkRegions:
    """Every live region, given to every inbound control link of one engine.

    No lock is held across a link's `add_region` (verbs pins memory there:
    seconds for tens of GiB, which must not stall registrations for other
    links or a new link's admission). None is needed, because a region is in
    the `RegionTable` before `registered` runs and a link is identified
    before `admit` runs: whichever of the two snapshots misses the other,
    the later one includes it, and a pair both reach is registered once
    (`add_region` is idempotent under the link's own lock). A link still
    being admitted has not sent its `Welcome`, and `register()` returns —
    so a sender can name the region — only after `registered` finished.
    """

    def __init__(self, regions: RegionTable, inbound: InboundTable, kind: type[ControlInbound]) -> None:
        self._regions, self._inbound, self._kind = regions, inbound, kind

    def links(self) -> list[ControlInbound]:
        """The live, identified inbound links of this engine's kind."""
        return [link for link in self._inbound.links()
                if isinstance(link, self._kind) and not link.dead and link.sender is not None]

    def registered(self, region: Region) -> None:
        """A region was registered: give it to every link (no lock held)."""
        for link in self.links():
            link.add_region(region)

    def admit(self, link: ControlInbound) -> list[Region]:
        """A new link: give it every live region; those regions (no lock held)."""
        regions = self._regions.live()
        for region in regions:
            link.add_region(region)
        return regions

    def deregistered(self, region: Region, timeout: float = 0.0) -> None:
        """A region was deregistered (its registrations closed): tell every link, then let each
        one settle it (`gone_settled`) within `timeout` s of one shared deadline. No lock held.
        """
        links = self.links()
        for link in links:
            link.region_gone(region.region_id)
        deadline = time.monotonic() + timeout
        for link in links:
            link.gone_settled(region.region_id, deadline)

