"""The nixl backend's one polling loop: it makes UCX progress, completes sends, delivers notifies.

NIXL has no completion callback and, with its own progress thread disabled
(see `inbound.py` for why), bytes move only inside NIXL calls that
progress a worker: `check_xfer_state` on the sending agent pushes a
transfer's bytes out, `get_new_notifs` on a receiving agent reads them into
our memory. So one thread per engine calls both in a loop, and sleeps
between rounds in an `Event.wait`, woken at once by `kick()` when a write
is submitted. It is the only polling loop in the backend. Waiting callers
never poll: they wait on their `Handle`'s event, with a timeout.

Cadence (#23), each a measured trade: while one of our writes is in flight
the loop polls every `MIN_DELAY` (over tcp its bytes move only when we
call NIXL, and backing off to 0.5 ms left the socket idle between calls);
while inbound bytes are arriving — a notification landed, or a receiving
agent's progress call took longer than `BUSY_CALL` (an idle call costs
~0.5 µs; reading a socket's worth of a transfer into memory takes far
longer) — likewise; otherwise it backs off, doubling to `MAX_DELAY`.

A round: (0) the writes links submitted are posted, in order
(`requests.Requests`); (1) every posted transfer's state — DONE releases the
NIXL request (and completes a write without notify), an error fails the
transfer and severs its link; (2) every live inbound link's notifications —
from its own agent, or, when the initiating agent serves every link
(`shared`, tls="all"), from that one agent's, handed out by sender — given
to the handler through the kit's `InboundLink.deliver` (never after a
fence) and then acknowledged to its sender in one `Acks` frame per link per
round.

The thread, its stop and wake-up and what happens when a round raises are
the kit's `loop_thread.LoopThread`: a round that raises ends the loop, logged
once, and the engine's `on_failure` fails every link at once
(`EngineBase.progress_failed`) — before, it was logged and retried every
round, up to 500 tracebacks a second while nothing moved.

Deletion condition: a NIXL Python API exposing the UCX worker's event fd or
a completion callback; then this becomes a blocking wait.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

from ..control import LinkRegions
from ..errors import TransportError
from ..loop_thread import LoopThread
from .requests import Requests

log = logging.getLogger(__name__)

MIN_DELAY = 50e-6
MAX_DELAY = 2e-3
# A receiving agent's progress call this long moved bytes (an idle one: ~0.5 us).
BUSY_CALL = 20e-6


class Progress:
    """The thread that drives one engine's NIXL agents."""

    def __init__(self, name: str, requests: Requests, links: LinkRegions, *,
                 shared: bool = False,
                 on_failure: Callable[[TransportError], None] | None = None) -> None:
        """`shared`: the initiating agent serves every inbound link (their notifications come from it).

        `on_failure(error)`: a round raised and the loop ended (`LoopThread`).
        """
        self._requests = requests
        self._links = links
        self._shared = shared
        self._delay = MIN_DELAY
        self._loop = LoopThread(f"nixl-progress {name}", self._turn, on_failure=on_failure)

    def on_thread(self) -> bool:
        """Whether the caller is this loop's thread (a notify handler runs there)."""
        return self._loop.on_thread

    def kick(self) -> None:
        """Run a round now (a write was submitted)."""
        self._loop.kick()

    def stop(self, timeout: float) -> bool:
        """Stop after the current round; waits at most `timeout` (a notify handler may block)."""
        return self._loop.stop(timeout)

    def _turn(self) -> float:
        worked, sending = self._round()
        self._delay = MIN_DELAY if worked or sending else min(self._delay * 2, MAX_DELAY)
        return self._delay

    def _round(self) -> tuple[bool, bool]:
        refused, worked = self._requests.post()
        for link, seq, error in refused:
            link.post_refused(seq, error)
        failed, done, notifs, sending = self._requests.poll(self._shared)
        for link, error in failed:
            worked = True
            link.sever(error)
        if done:
            worked = True
            by_link: dict = defaultdict(list)
            for link, seq in done:
                by_link[link].append(seq)
            for link, seqs in by_link.items():
                link.acked(seqs)
        peers = self._links.links()
        if self._shared:
            worked = self._hand_out(peers, notifs) or worked
            return worked, sending
        for peer in peers:
            t0 = time.perf_counter()
            landed = peer.poll()
            if time.perf_counter() - t0 > BUSY_CALL:
                worked = True  # bytes were moving into our memory: keep polling closely
            if landed:
                worked = True
                peer.hand_over(landed)  # the kit's delivery rule, then one Acks frame
        return worked, sending

    def _hand_out(self, peers: list, notifs: dict[str, list[bytes]]) -> bool:
        """Shared agent: give each link the notifications of its sender (others: stale, dropped)."""
        if not notifs:
            return False
        by_sender = {p.sender: p for p in peers}  # one live link per sender
        for name, messages in notifs.items():
            peer = by_sender.get(name)
            if peer is None:
                log.debug("nixl: %d notification(s) from %s, which has no live link", len(messages), name)
                continue
            landed = peer.landed({name: messages})
            if landed:
                peer.hand_over(landed)
        return True
