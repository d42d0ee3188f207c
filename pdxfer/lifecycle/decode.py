"""A decode request's lifecycle: announce it, prove every part and layer landed, finish once.

    DIALING ──welcome──► EXPECTED ──landed──► RECEIVING ──last part──► SUCCEEDED
       │                    │                    │
       │ abort/lost         └──abort/timeout─────┴──► ABORTING ──clean ack──► FAILED
       ▼                    └──lost/peer abort(fence)───┐  │ cut ack / no ack in grace
     FAILED                                             ▼  ▼
                                                      FENCING ──drop_peer returned──► FAILED

Where the transport cannot fence (`fence=False`: one-sided UCX cma/cuda_ipc/rc,
verbs fence="qp", a forced test option), every arrow into FENCING goes instead:

    ABORTING ──no ack in grace──► QUARANTINED ──AbortAck / the prefill's Abort──► FAILED
    EXPECTED/RECEIVING/ABORTING/QUARANTINED ──link lost──► ORPHANED ──peer gone──► FAILED

and a cut AbortAck, or the prefill's Abort(fence), ends in FAILED once nothing
of the request can still land. The prefill sends its word only after every
handle of the request completed or failed, or its cut connection's close
returned — which does not stop bytes already in flight (tcp's socket
buffers, a one-sided write the sender's NIC or CPU still runs). So a word
naming data `links` the request was posted on and that were closed (#25.1)
holds the request in QUARANTINED until the transport shows every one of them
settled (`on_quiet`, asked by the driver); with a fence, a cut still fences
and links that merely closed are waited for the same way. QUARANTINED and
ORPHANED poll as `KVPoll.Quarantined` with the failure's reason: not
finished, entries not free.

See `pdxfer.lifecycle` for the rules both sides keep.
"""

from __future__ import annotations

import enum

from ..config import KVPoll
from ..errors import ProtocolError, RequestError, TransferTimeout
from ..protocol import Abort, Done, Expect
from .effects import Fence, Finish, Quarantine, Send, Timing, visible


# -- the decode side -------------------------------------------------------------------
class DPhase(enum.Enum):
    """A decode request's phase."""

    DIALING = "dialing"  # waiting for the prefill's handshake (Bootstrapping)
    EXPECTED = "expected"  # Expect sent, nothing landed yet (WaitingForInput)
    RECEIVING = "receiving"  # some transfers landed (Transferring)
    ABORTING = "aborting"  # Abort sent; waiting for the AbortAck or the grace
    FENCING = "fencing"  # drop_peer is running; finishes in on_fenced
    QUARANTINED = "quarantined"  # failed, no fence: waiting for the prefill's AbortAck/Abort
    ORPHANED = "orphaned"  # failed, no fence, link lost: waiting for the prefill to be gone
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_D_POLL = {DPhase.DIALING: KVPoll.Bootstrapping, DPhase.EXPECTED: KVPoll.WaitingForInput,
           DPhase.RECEIVING: KVPoll.Transferring, DPhase.SUCCEEDED: KVPoll.Success,
           DPhase.FAILED: KVPoll.Failed, DPhase.QUARANTINED: KVPoll.Quarantined,
           DPhase.ORPHANED: KVPoll.Quarantined}
_WAITING = (DPhase.ABORTING, DPhase.FENCING, DPhase.QUARANTINED, DPhase.ORPHANED)
# The phases whose `deadline` means something to `on_tick`.
_TIMED = (DPhase.DIALING, DPhase.EXPECTED, DPhase.RECEIVING, DPhase.ABORTING)


class DecodeLife:
    """One request on the decode: announce it, count the parts that land, finish once."""

    __slots__ = ("aborting", "can_fence", "claimed", "complete", "deadline", "depth", "expect",
                 "fence_why", "id", "last_chunk", "landed", "layers", "links", "partial", "parts",
                 "phase", "seen", "spans", "timing", "told", "xid")

    def __init__(self, rid: str, xid: int, expect: Expect, timing: Timing, now: float, *,
                 fence: bool = True, depth: int = 1) -> None:
        """`fence`: the transport's `capabilities.fence` — drop_peer, or quarantine.

        `depth`: the layers a span must land (`pools.PoolSet.depth`: the
        deepest field of any pool, the same number on both sides of a
        matched handshake).
        """
        self.id, self.xid, self.expect, self.timing = rid, xid, expect, timing
        self.can_fence = fence
        self.depth = depth
        self.phase = DPhase.DIALING
        self.deadline = now + timing.wait
        self.parts: dict[int, int] = {}  # chunk -> transfers it has
        self.landed: dict[int, set[int]] = {}  # chunk -> the parts of it that landed
        self.complete = 0  # chunks with every part landed
        self.last_chunk: int | None = None
        # Streamed layer ranges (#33): chunk -> (span, lo, hi) as its first notify announced it;
        # span -> the layers its announced chunks claim (no two may share a layer); span -> the
        # layers of its WHOLE chunks; the spans seen whose landed layers are not yet all `depth`.
        self.spans: dict[int, tuple[int, int, int]] = {}
        self.claimed: dict[int, set[int]] = {}
        self.layers: dict[int, set[int]] = {}
        self.partial: set[int] = set()
        self.aborting: tuple[str, BaseException | None] | None = None
        self.told = False  # a failure before the Expect left was told to the prefill
        self.fence_why = ""
        # The prefill's data links that may still land bytes of it: Failed once all settled.
        self.links: frozenset[str] = frozenset()
        self.seen = KVPoll.Bootstrapping

    @property
    def finished(self) -> bool:
        return self.phase in (DPhase.SUCCEEDED, DPhase.FAILED)

    @property
    def poll(self) -> KVPoll:
        """The caller's view (`effects.visible`)."""
        return visible(_D_POLL, self)

    @property
    def wakes_at(self) -> float | None:
        """When `on_tick` may next change something: the deadline of a timed phase, else None.

        A driver need only tick the request then (and after any transition
        that moved this earlier): the deadline only ever moves later otherwise.
        """
        return self.deadline if self.phase in _TIMED else None

    @property
    def settling(self) -> bool:
        """Failed without a fence and waiting on the transport (`on_quiet`, `on_peer_gone`)."""
        return self.phase is DPhase.ORPHANED or (self.phase is DPhase.QUARANTINED and bool(self.links))

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

    def on_landed(self, chunk: int, part: int, parts: int, last: bool, now: float,
                  span: int | None = None, lo: int = 0, hi: int = 0) -> list:
        """One transfer's notify: Success once every part of every chunk 0..last has landed
        and every span among them has every layer.

        A proof, not a count: each chunk keeps the set of its parts that
        landed, and a notify that cannot belong to the request — a part
        already landed, a part or chunk outside its range, a second "last"
        chunk, a part count that changed, a layer range outside `depth` or
        sharing a layer with another chunk of its span — fails the request
        as a protocol error naming what was wrong (#29.5). Then "every chunk
        through the last is whole" holds exactly when the number of whole
        chunks is last + 1: every chunk counted lies in 0..last and is
        counted once. Each whole chunk adds its layers `[lo, hi)` to its
        span's set (`hi == 0`: every layer; `span` None: the chunk is a span
        of its own); a span is whole when that set holds every layer
        0..depth-1, and Success needs no span left partial (#33).
        """
        if self.phase not in (DPhase.EXPECTED, DPhase.RECEIVING):
            return []  # aborting, fencing or final: late notifies count for nothing
        if span is None:
            span = chunk
        if hi == 0 and lo == 0:
            hi = self.depth
        bad = self._bad_notify(chunk, part, parts, last) or self._bad_layers(chunk, span, lo, hi)
        if bad is not None:
            return self.on_abort(f"prefill sent an inconsistent notify for chunk {chunk} (part "
                                 f"{part} of {parts}): {bad}", now,
                                 ProtocolError(f"inconsistent notify: {bad}"))
        if chunk not in self.spans:
            self.spans[chunk] = (span, lo, hi)
            self.claimed.setdefault(span, set()).update(range(lo, hi))
        self.parts.setdefault(chunk, parts)
        got = self.landed.setdefault(chunk, set())
        got.add(part)
        if len(got) == parts:
            self.complete += 1
            have = self.layers.setdefault(span, set())
            have.update(range(lo, hi))
            if len(have) == self.depth:
                self.partial.discard(span)
            else:
                self.partial.add(span)
        if last:
            self.last_chunk = chunk
        self.deadline = now + self.timing.wait
        if self.last_chunk is None or self.complete != self.last_chunk + 1 or self.partial:
            self.phase = DPhase.RECEIVING
            return []
        self.phase = DPhase.SUCCEEDED
        return [Finish(True), Send(Done(self.id, self.xid))]

    def _bad_notify(self, chunk: int, part: int, parts: int, last: bool) -> str | None:
        """What makes this notify impossible for the request, or None."""
        if chunk < 0 or parts < 1 or not 0 <= part < parts:
            return "part must be in 0..parts-1 of a chunk >= 0 with parts >= 1"
        expected = self.parts.get(chunk, parts)
        if expected != parts:
            return f"chunk {chunk} was announced with {expected} parts"
        if part in self.landed.get(chunk, ()):
            return f"part {part} of chunk {chunk} already landed (a duplicate notify)"
        if self.last_chunk is not None and chunk > self.last_chunk:
            return f"chunk {chunk} is past the last chunk {self.last_chunk}"
        if last:
            if self.last_chunk is not None and chunk != self.last_chunk:
                return f"chunk {self.last_chunk} was already the last"
            beyond = [c for c in self.parts if c > chunk]
            if beyond:
                return f"chunk {max(beyond)} landed past this last chunk"
        return None

    def _bad_layers(self, chunk: int, span: int, lo: int, hi: int) -> str | None:
        """What makes this chunk's span and layers impossible for the request, or None."""
        if span < 0 or not 0 <= lo < hi <= self.depth:
            return (f"span {span} layers [{lo}, {hi}) must be a span >= 0 and a layer range "
                    f"inside the pools' {self.depth} layers")
        known = self.spans.get(chunk)
        if known is not None:
            return None if known == (span, lo, hi) else (
                f"chunk {chunk} was announced as span {known[0]} layers [{known[1]}, {known[2]})")
        shared = self.claimed.get(span)
        if shared and not shared.isdisjoint(range(lo, hi)):
            return (f"layers [{lo}, {hi}) of span {span} overlap layers another chunk of it "
                    "already carries")
        return None

    def on_abort(self, reason: str, now: float, error: BaseException | None = None) -> list:
        """Give up (caller, timeout, bad notify): at once if no byte can come, else ask the prefill."""
        if self.finished or self.phase in _WAITING:
            return []
        self.aborting = (reason, error)
        if self.phase is DPhase.DIALING:
            self.phase = DPhase.FAILED
            return [Finish(False, reason, error)]
        self.phase = DPhase.ABORTING
        self.deadline = now + self.timing.grace
        return [Send(Abort(self.id, self.xid, reason, False))]

    def on_peer_abort(self, reason: str, fence: bool, links: tuple | list = ()) -> list:
        """The prefill failed it; `fence`: it cut transfers whose bytes may still be in flight.

        The prefill says so only once its transfers completed, failed or were
        cut; `links` names the closed data links they may still be landing
        through. Without a fence, Failed once those settled (`on_quiet`).
        """
        if self.finished or self.phase in (DPhase.FENCING, DPhase.DIALING, DPhase.ORPHANED):
            return []
        if self.aborting is None:
            self.aborting = (reason, RequestError(reason))
        if fence and self.can_fence:
            return self._fence(reason)
        return self._settle("the prefill confirmed its transfers ended", links,
                            said=self._held or bool(links))

    def on_abort_ack(self, clean: bool, links: tuple | list = ()) -> list:
        """The prefill's answer to our Abort: finished cleanly, or cut (then fence, if we can).

        `links`: as in `on_peer_abort` — Failed only once they settled.
        """
        if self.phase not in (DPhase.ABORTING, DPhase.QUARANTINED):
            return []
        if clean:
            return self._settle("the prefill confirmed its transfers ended", links,
                                said=self._held or bool(links))
        if self.can_fence:
            return self._fence("the prefill cut its transfers; fenced it")
        return self._settle("the prefill cut its transfers and confirmed it", links, said=True)

    def on_quiet(self) -> list:
        """Every data link the prefill named has settled: nothing of the request can land. Failed."""
        if self.phase is not DPhase.QUARANTINED or not self.links:
            return []
        return self._final(self.fence_why)

    def on_link_lost(self, reason: str, error: BaseException) -> list:
        """The control link died: before the Expect nothing can land; after it, fence.

        Without a fence no ack can come any more: ORPHANED until `on_peer_gone`.
        """
        if self.finished or self.phase in (DPhase.FENCING, DPhase.ORPHANED):
            return []
        if self.aborting is None:
            self.aborting = (reason, error)
        if self.phase is DPhase.DIALING:
            self.phase = DPhase.FAILED
            return [Finish(False, reason, error)]
        if self.can_fence:
            return self._fence(reason)
        return self._hold(DPhase.ORPHANED, f"control link lost ({reason}); quarantined until the "
                          "transport reports the prefill's data connections closed")

    def on_peer_gone(self) -> list:
        """The transport shows every link of the prefill settled (`settled(engine)`): free it.

        Only after the control link was lost: while it lives the prefill may
        reopen a data connection and is asked instead.
        """
        if self.phase is not DPhase.ORPHANED:
            return []
        return self._final("released from quarantine: the prefill's connections are closed")

    def on_tick(self, now: float, peer: str | None = None) -> list:
        """No progress within the wait: abort; no AbortAck within the grace: fence.

        `peer`: the prefill's address, named in a timeout (a stalled peer is found by it).
        """
        if self.deadline > now:
            return []
        if self.phase is DPhase.ABORTING:
            why = f"prefill did not confirm the abort within {self.timing.grace} s"
            if not self.can_fence:
                return self._hold(DPhase.QUARANTINED, f"{why}; quarantined until it does (the "
                                  "transport cannot fence)")
            return self._fence(f"{why}; fenced it")
        if self.phase in (DPhase.DIALING, DPhase.EXPECTED, DPhase.RECEIVING):
            msg = (f"request {self.id!r} timed out: no progress for {self.timing.wait} s while "
                   f"{self.poll.name}" + (f" (prefill at {peer})" if peer else ""))
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

    def _settle(self, why: str, links: tuple | list, said: bool) -> list:
        """The prefill's word: Failed now, or — bytes may still come through `links` — once they settle.

        A request already waiting for links keeps waiting (for their union):
        a later word never undoes an earlier one's links.
        """
        if self.links or links:
            first = not self.links
            self.links = self.links | frozenset(links)
            if not first:
                return []
            reason, error = self.aborting or ("failed", None)
            names = ", ".join(sorted(n or "every link" for n in self.links))
            self.phase = DPhase.QUARANTINED
            self.fence_why = why
            return [Quarantine(f"{reason} [{why}; quarantined until the transport shows its data "
                               f"link(s) {names} settled: bytes sent before they closed may still "
                               "land]", error)]
        return self._final(why if said else None)

    def _fence(self, why: str) -> list:
        self.poll  # noqa: B018 — keep the running state visible while fencing
        self.phase = DPhase.FENCING
        self.fence_why = why
        return [Fence()]

    @property
    def _held(self) -> bool:
        return self.phase in (DPhase.QUARANTINED, DPhase.ORPHANED)

    def _hold(self, phase: DPhase, why: str) -> list:
        """Quarantine: failed, but a byte may still land and nothing here can stop it."""
        reason, error = self.aborting or ("failed", None)
        self.phase = phase
        self.fence_why = why
        return [Quarantine(f"{reason} [{why}]", error)]

    def _final(self, why: str | None) -> list:
        reason, error = self.aborting or ("failed", None)
        if why and why != reason:
            reason = f"{reason} ({why})"
        self.phase = DPhase.FAILED
        return [Finish(False, reason, error)]
