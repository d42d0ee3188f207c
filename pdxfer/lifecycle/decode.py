"""A decode request's lifecycle: announce it, count the parts that land, finish once.

    DIALING ──welcome──► EXPECTED ──landed──► RECEIVING ──last part──► SUCCEEDED
       │                    │                    │
       │ abort/lost         └──abort/timeout─────┴──► ABORTING ──clean ack──► FAILED
       ▼                    └──lost/peer abort(fence)───┐  │ cut ack / no ack in grace
     FAILED                                             ▼  ▼
                                                      FENCING ──drop_peer returned──► FAILED

See `pdxfer.lifecycle` for the rules both sides keep.
"""

from __future__ import annotations

import enum

from ..config import KVPoll
from ..errors import ProtocolError, RequestError, TransferTimeout
from ..protocol import Abort, Done, Expect
from .effects import Fence, Finish, Send, Timing, visible


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
        """The caller's view (`effects.visible`)."""
        return visible(_D_POLL, self)

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
