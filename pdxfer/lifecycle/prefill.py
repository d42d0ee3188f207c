"""A prefill request's lifecycle: queue chunks until expected, post them in order, finish once.

    QUEUED ──expect──► EXPECTED ──send/link ready──► POSTING ──last──► DRAINING ──done──► SUCCEEDED
      │                   │                             │                 │
      └──abort/timeout/link lost/post failed────────────┴─────────────────┴──► FAILING ──► FAILED
                                       (transfers finished, or cut after the grace and closed)

See `pdxfer.lifecycle` for the rules both sides keep.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from ..config import KVPoll
from ..errors import PeerLostError, RequestError, TransferTimeout
from ..protocol import Abort, AbortAck
from .effects import Cut, Finish, Post, Send, Timing, visible


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
        """The caller's view (`effects.visible`)."""
        return visible(_P_POLL, self)

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

    def on_renew(self, now: float) -> list:
        """The decode still has it queued (`Renew`): a sent request waits for its Expect anew.

        Only the wait for the Expect is renewed: once expected, the decode's
        own timers and the Done bound the request.
        """
        if self.phase is PPhase.QUEUED and self.local:
            self.deadline = max(self.deadline, now + self.timing.wait)
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


