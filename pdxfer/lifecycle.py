"""Request lifecycles as pure state machines: what a request may do next, and what that costs.

A request's state used to be a dozen flags (`failing`, `cut`, `ack`,
`last_sent`, `aborting`, ...) set by a dozen handlers; every fault in the
control plane was two of them disagreeing. Here each side's request is ONE
object with ONE phase enum, and every event is a method (`on_send`,
`on_expect`, `on_landed`, `on_done`, `on_abort`, `on_link_lost`,
`on_tick` for deadlines, `on_close`) that moves the phase and returns the
*effects* the driver must carry out: `Post` a chunk, `Send` a control
message, `Cut` the data connection, `Fence` the peer, `Finish` the request.

Nothing here touches a socket, a lock, a clock or a transport: time comes in
as `now`, whether transfers are still reading memory comes in as `inflight`,
and whether the peer's data link is usable comes in as `ready`. So the whole
lifecycle is tested by scripted event sequences in microseconds
(`tests/pdxfer/test_lifecycle.py`), and the drivers (`prefill.py`,
`decode.py`) only look a record up, call one transition under the table
lock, and run the effects.

The one rule both machines keep: `Finish` is returned once, and only when no
byte of the request can still land (decode) or be read (prefill) — a failing
request with transfers in flight waits for them, or for the `Cut`/`Fence`
that ends them, before it finishes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from .config import KVPoll
from .errors import PeerLostError, ProtocolError, RequestError, TransferTimeout
from .protocol import Abort, AbortAck, Done, Expect


# -- effects ------------------------------------------------------------------------
@dataclass(frozen=True)
class Post:
    """Plan and post `chunk` on the peer's data connection now (in the order returned)."""

    chunk: Any


@dataclass(frozen=True)
class Send:
    """Send `msg` on the request's control link (on the progress thread)."""

    msg: Any


@dataclass(frozen=True)
class Cut:
    """Close the data connection to the request's peer: its transfers stop reading now."""


@dataclass(frozen=True)
class Fence:
    """`drop_peer` the request's prefill, then report `on_fenced()`: nothing of it lands after."""


@dataclass(frozen=True)
class Finish:
    """The request is final: Success (`ok`) or Failed with `reason` and `error`."""

    ok: bool
    reason: str | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Timing:
    """The two waits a request obeys, from `EngineConfig` (`request_wait`, `grace`)."""

    wait: float  # no progress for this long while waiting for input or confirmation: fail
    grace: float  # a failing request's transfers get this long before they are cut


# -- the prefill side -----------------------------------------------------------------
class PPhase(enum.Enum):
    """A prefill request's phase; `poll` maps it to the caller's `KVPoll`."""

    QUEUED = "queued"  # send() came first; no Expect yet (Bootstrapping)
    EXPECTED = "expected"  # the decode expects it; nothing posted yet (WaitingForInput)
    POSTING = "posting"  # chunks posted, not the last (Transferring)
    DRAINING = "draining"  # the last chunk posted; waiting for Done (Transferring)
    FAILING = "failing"  # failed; waiting for in-flight transfers to end, or to cut them
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_P_POLL = {PPhase.QUEUED: KVPoll.Bootstrapping, PPhase.EXPECTED: KVPoll.WaitingForInput,
           PPhase.POSTING: KVPoll.Transferring, PPhase.DRAINING: KVPoll.Transferring,
           PPhase.SUCCEEDED: KVPoll.Success, PPhase.FAILED: KVPoll.Failed}


class PrefillLife:
    """One request on the prefill: queue chunks until expected, post them in order, finish once."""

    __slots__ = ("ack", "cut", "cutting", "deadline", "fail_by", "failing", "id", "last_accepted",
                 "local", "pending", "phase", "seen", "timing", "xid")

    def __init__(self, rid: str, timing: Timing, now: float, *, local: bool) -> None:
        self.id, self.timing, self.xid = rid, timing, 0
        self.phase = PPhase.QUEUED
        self.local = local  # the caller has send() it; else only the decode knows it
        self.last_accepted = False  # a chunk marked last was accepted (queued or posted)
        self.pending: list[Any] = []  # chunks accepted before they could be posted
        self.deadline = now + timing.wait if local else math.inf
        self.failing: tuple[str, BaseException | None] | None = None
        self.fail_by = math.inf
        self.ack = False  # the decode asked for the abort: answer AbortAck, not Abort
        self.cut = False  # transfers were cut in flight: the decode must fence
        self.cutting = False  # a close of its data connection is running
        self.seen = KVPoll.Bootstrapping  # what poll last reported while running

    @property
    def finished(self) -> bool:
        return self.phase in (PPhase.SUCCEEDED, PPhase.FAILED)

    @property
    def expected(self) -> bool:
        """The decode's Expect arrived (its xid names this use of the id)."""
        return self.xid != 0

    @property
    def poll(self) -> KVPoll:
        """The caller's view; a failing request still reports where it was until it finishes."""
        state = _P_POLL.get(self.phase)
        if state is not None:
            self.seen = state if not self.finished else self.seen
            return state
        return self.seen

    # -- the caller --------------------------------------------------------------------
    def check_send(self, last: bool) -> bool:
        """Refuse a send after the last chunk or after Success; False: ignore it (already failed).

        Pure, so the driver can ask before planning and a refusal changes nothing.
        """
        if self.phase is PPhase.SUCCEEDED or self.last_accepted:
            raise RequestError(
                f"request {self.id!r} already sent its last chunk ({self.poll.name}); a "
                "duplicate send is refused — use a new id, or release() and resend"
            )
        return self.phase not in (PPhase.FAILED, PPhase.FAILING)

    def posts_now(self, ready: bool) -> bool:
        """Whether a chunk accepted now is posted at once (else queued until expected and ready)."""
        return ready and self.phase in (PPhase.EXPECTED, PPhase.POSTING) and not self.pending

    def on_send(self, chunk: Any, last: bool, ready: bool, now: float) -> list:
        """Accept a chunk (after `check_send`): post it, or queue it."""
        if not self.check_send(last):
            return []
        self.local = True
        self.last_accepted = last
        if self.posts_now(ready):
            return self._posted([Post(chunk)], last, now)
        self.pending.append(chunk)
        if self.phase is PPhase.QUEUED and len(self.pending) == 1:
            self.deadline = now + self.timing.wait  # waiting for an Expect from now on
        return []

    def on_abort(self, reason: str, now: float, inflight: bool) -> list:
        """The local caller gives up."""
        return self._fail(reason, None, now, inflight)

    # -- the decode ------------------------------------------------------------------------
    def on_expect(self, xid: int, ready: bool, now: float, inflight: bool) -> list:
        """The decode's Expect: post what is queued, or answer why it cannot be served."""
        if self.expected or self.phase is PPhase.SUCCEEDED:
            return [Send(Abort(self.id, xid, (
                f"duplicate request id {self.id!r}: this prefill already has it "
                f"({self.poll.name}); request ids must be unique per prefill"), False))]
        if self.phase is PPhase.FAILED:
            return [Send(Abort(self.id, xid, self.failing[0] if self.failing else "failed", False))]
        self.xid = xid
        if self.phase is PPhase.FAILING:  # aborted locally before the Expect came
            return self._settle(inflight)
        self.phase = PPhase.EXPECTED
        self.deadline = now + self.timing.wait if self.local else math.inf
        return self.on_link_ready(now) if ready else []

    def on_link_ready(self, now: float) -> list:
        """The peer's data connection is (again) usable: post everything queued, in order."""
        if self.phase not in (PPhase.EXPECTED, PPhase.POSTING) or not self.pending:
            return []
        chunks, self.pending = self.pending, []
        return self._posted([Post(c) for c in chunks], self.last_accepted, now)

    def on_done(self) -> list:
        """The decode saw every byte: Success, if the last chunk was posted and nothing failed."""
        if self.phase is not PPhase.DRAINING:
            return []
        self.phase = PPhase.SUCCEEDED
        return [Finish(True)]

    def on_peer_abort(self, reason: str, now: float, inflight: bool) -> list:
        """The decode gave up on it; answer AbortAck once nothing reads the source."""
        if self.finished:
            return [Send(AbortAck(self.id, self.xid, not self.cut))]
        if self.phase is PPhase.QUEUED:  # the decode gave up before its Expect went out
            return self._fail(reason, None, now, inflight)
        self.ack = True
        if self.phase is PPhase.FAILING:
            return self._settle(inflight)
        return self._fail(reason, None, now, inflight)

    def on_link_lost(self, reason: str, now: float, inflight: bool) -> list:
        """The control link to the decode died: nothing can confirm this request any more."""
        return self._fail(reason, PeerLostError(reason), now, inflight)

    def on_link_cut(self, reason: str, now: float, inflight: bool, *, fenced: bool) -> list:
        """The data connection is being closed; transfers in flight will not all land.

        `fenced`: the decode closed it (drop_peer) and already guarantees no
        byte lands, so it need not fence again; otherwise this side cut it and
        the decode must fence. Either way the request stays Failing until
        `on_cut_done`: the close must return before the source is free.
        """
        if not inflight or self.finished:
            return []
        self.cut = self.cut or not fenced
        self.cutting = True
        effects = self._fail(reason, PeerLostError(reason), now, inflight=True)
        self.cut = self.cut or not fenced  # _fail may not have run: keep the mark
        return effects

    def on_cut_done(self, inflight: bool) -> list:
        """The cut connection's close() returned: nothing reads the source through it now."""
        self.cutting = False
        return self._settle(inflight)

    # -- the driver's reports ----------------------------------------------------------------
    def on_post_failed(self, reason: str, error: BaseException, now: float, inflight: bool) -> list:
        """A post was refused (planning) or failed (transport)."""
        return self._fail(reason, error, now, inflight)

    def on_transfer_failed(self, reason: str, error: BaseException, now: float) -> list:
        """A posted transfer failed: it reads no more, but the decode cannot complete."""
        return self._fail(reason, error, now, inflight=False)

    def on_tick(self, now: float, inflight: bool) -> list:
        """Deadlines: a request waiting too long fails; a failing one finishes or is cut."""
        if self.phase is PPhase.FAILING:
            if not inflight:
                return self._settle(False)
            return [Cut()] if now >= self.fail_by and not self.cutting else []
        if self.finished or self.deadline > now:
            return []
        what = ("no decode expected it" if self.phase is PPhase.QUEUED
                else "no chunk was sent for it" if self.phase is PPhase.EXPECTED
                else "decode did not confirm the data")
        msg = f"request {self.id!r}: {what} within {self.timing.wait} s"
        return self._fail(msg, TransferTimeout(msg), now, inflight)

    def on_close(self, reason: str, error: BaseException) -> list:
        """The engine is closing (its data connections already closed): finish now."""
        if self.finished:
            return []
        if self.failing is None:
            self.failing = (reason, error)
        self.phase = PPhase.FAILING
        self.cutting = False
        return self._settle(False)

    # -- internals ---------------------------------------------------------------------------
    def _posted(self, effects: list, last: bool, now: float) -> list:
        self.phase = PPhase.DRAINING if last else PPhase.POSTING
        self.deadline = now + self.timing.wait if last else math.inf
        return effects

    def _fail(self, reason: str, error: BaseException | None, now: float, inflight: bool) -> list:
        if self.finished or self.phase is PPhase.FAILING:
            return []
        self.poll  # noqa: B018 — remember the running state the caller sees until the finish
        self.failing = (reason, error)
        self.phase = PPhase.FAILING
        self.fail_by = now + self.timing.grace
        self.pending = []
        return self._settle(inflight)

    def _settle(self, inflight: bool) -> list:
        """Finish a failing request once nothing of it reads the source; tell the decode."""
        if inflight or self.cutting or self.phase is not PPhase.FAILING:
            return []
        assert self.failing is not None
        reason, error = self.failing
        self.phase = PPhase.FAILED
        effects: list = [Finish(False, reason, error)]
        if self.xid:
            msg = (AbortAck(self.id, self.xid, not self.cut) if self.ack
                   else Abort(self.id, self.xid, reason, self.cut))
            effects.append(Send(msg))
        return effects


# -- the decode side -------------------------------------------------------------------
class DPhase(enum.Enum):
    """A decode request's phase."""

    DIALING = "dialing"  # waiting for the prefill's handshake (Bootstrapping)
    EXPECTED = "expected"  # Expect sent, nothing landed yet (WaitingForInput)
    RECEIVING = "receiving"  # some transfers landed (Transferring)
    ABORTING = "aborting"  # Abort sent; waiting for the AbortAck or the grace
    FENCING = "fencing"  # drop_peer is running; finishes in on_fenced
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_D_POLL = {DPhase.DIALING: KVPoll.Bootstrapping, DPhase.EXPECTED: KVPoll.WaitingForInput,
           DPhase.RECEIVING: KVPoll.Transferring, DPhase.SUCCEEDED: KVPoll.Success,
           DPhase.FAILED: KVPoll.Failed}


class DecodeLife:
    """One request on the decode: announce it, count the parts that land, finish once."""

    __slots__ = ("aborting", "complete", "deadline", "expect", "fence_why", "id", "last_chunk",
                 "landed", "parts", "phase", "seen", "timing", "told", "xid")

    def __init__(self, rid: str, xid: int, expect: Expect, timing: Timing, now: float) -> None:
        self.id, self.xid, self.expect, self.timing = rid, xid, expect, timing
        self.phase = DPhase.DIALING
        self.deadline = now + timing.wait
        self.parts: dict[int, int] = {}  # chunk -> transfers it has
        self.landed: dict[int, int] = {}  # chunk -> transfers landed
        self.complete = 0  # chunks with every part landed
        self.last_chunk: int | None = None
        self.aborting: tuple[str, BaseException | None] | None = None
        self.told = False  # a failure before the Expect left was told to the prefill
        self.fence_why = ""
        self.seen = KVPoll.Bootstrapping

    @property
    def finished(self) -> bool:
        return self.phase in (DPhase.SUCCEEDED, DPhase.FAILED)

    @property
    def poll(self) -> KVPoll:
        state = _D_POLL.get(self.phase)
        if state is not None:
            self.seen = state if not self.finished else self.seen
            return state
        return self.seen

    def on_link_ready(self, now: float) -> list:
        """The handshake finished: send the Expect, or tell the prefill it was aborted meanwhile."""
        if self.phase is DPhase.DIALING:
            self.phase = DPhase.EXPECTED
            self.deadline = now + self.timing.wait
            return [Send(self.expect)]
        if self.phase is DPhase.FAILED and not self.told and self.aborting is not None:
            self.told = True  # a prefill that already has the send() fails it now, not at a timeout
            return [Send(Abort(self.id, self.xid, self.aborting[0], False))]
        return []

    def on_landed(self, chunk: int, part: int, parts: int, last: bool, now: float) -> list:
        """One transfer's notify: Success once the last chunk and every earlier one are whole."""
        if self.phase not in (DPhase.EXPECTED, DPhase.RECEIVING):
            return []  # aborting, fencing or final: late notifies count for nothing
        expected = self.parts.setdefault(chunk, parts)
        if expected != parts or not 0 <= part < parts:
            return self.on_abort(f"prefill sent an inconsistent notify for chunk {chunk} (part "
                                 f"{part} of {parts}, expected {expected} parts)", now,
                                 ProtocolError("inconsistent notify"))
        got = self.landed.get(chunk, 0) + 1
        self.landed[chunk] = got
        if got == expected:
            self.complete += 1
        if last:
            self.last_chunk = chunk
        self.deadline = now + self.timing.wait
        if self.last_chunk is None or self.complete != self.last_chunk + 1:
            self.phase = DPhase.RECEIVING
            return []
        self.phase = DPhase.SUCCEEDED
        return [Finish(True), Send(Done(self.id, self.xid))]

    def on_abort(self, reason: str, now: float, error: BaseException | None = None) -> list:
        """Give up (caller, timeout, bad notify): at once if no byte can come, else ask the prefill."""
        if self.finished or self.phase in (DPhase.ABORTING, DPhase.FENCING):
            return []
        self.aborting = (reason, error)
        if self.phase is DPhase.DIALING:
            self.phase = DPhase.FAILED
            return [Finish(False, reason, error)]
        self.phase = DPhase.ABORTING
        self.deadline = now + self.timing.grace
        return [Send(Abort(self.id, self.xid, reason, False))]

    def on_peer_abort(self, reason: str, fence: bool) -> list:
        """The prefill failed it; `fence`: its bytes may still be in flight."""
        if self.finished or self.phase is DPhase.FENCING or self.phase is DPhase.DIALING:
            return []
        if self.aborting is None:
            self.aborting = (reason, RequestError(reason))
        return self._fence(reason) if fence else self._final(None)

    def on_abort_ack(self, clean: bool) -> list:
        """The prefill's answer to our Abort: finished cleanly, or cut (then fence)."""
        if self.phase is not DPhase.ABORTING:
            return []
        return self._final(None) if clean else self._fence("the prefill cut its transfers; fenced it")

    def on_link_lost(self, reason: str, error: BaseException) -> list:
        """The control link died: before the Expect nothing can land; after it, fence."""
        if self.finished or self.phase is DPhase.FENCING:
            return []
        if self.aborting is None:
            self.aborting = (reason, error)
        if self.phase is DPhase.DIALING:
            self.phase = DPhase.FAILED
            return [Finish(False, reason, error)]
        return self._fence(reason)

    def on_tick(self, now: float) -> list:
        """No progress within the wait: abort; no AbortAck within the grace: fence."""
        if self.deadline > now:
            return []
        if self.phase is DPhase.ABORTING:
            return self._fence(f"prefill did not confirm the abort within {self.timing.grace} s; fenced it")
        if self.phase in (DPhase.DIALING, DPhase.EXPECTED, DPhase.RECEIVING):
            msg = (f"request {self.id!r} timed out: no progress for {self.timing.wait} s while "
                   f"{self.poll.name}")
            return self.on_abort(msg, now, TransferTimeout(msg))
        return []

    def on_fenced(self) -> list:
        """drop_peer returned: no byte of this request can land any more."""
        if self.phase is not DPhase.FENCING:
            return []
        return self._final(self.fence_why)

    def on_close(self, reason: str, error: BaseException) -> list:
        """The engine is closing: tell the prefill if it knows the request; Failed."""
        if self.finished:
            return []
        told = self.phase in (DPhase.EXPECTED, DPhase.RECEIVING)
        self.phase = DPhase.FAILED
        effects: list = [Finish(False, reason, error)]
        if told:
            effects.append(Send(Abort(self.id, self.xid, reason, False)))
        return effects

    def _fence(self, why: str) -> list:
        self.poll  # noqa: B018 — keep the running state visible while fencing
        self.phase = DPhase.FENCING
        self.fence_why = why
        return [Fence()]

    def _final(self, why: str | None) -> list:
        reason, error = self.aborting or ("failed", None)
        if why and why != reason:
            reason = f"{reason} ({why})"
        self.phase = DPhase.FAILED
        return [Finish(False, reason, error)]
