"""The nixl backend's one polling loop: it makes UCX progress, completes sends, delivers notifies.

NIXL has no completion callback and, with its own progress thread disabled
(see `inbound.py` for why), bytes move only inside NIXL calls that
progress a worker: `check_xfer_state` on the sending agent pushes a
transfer's bytes out, `get_new_notifs` on a receiving agent reads them into
our memory. So one thread per engine calls both in a loop, and sleeps
between rounds with a backoff: 50 µs after a round that found work, doubling
to 2 ms while idle (0.5 ms while a send is in flight), and woken at once by
`kick()` when a write is submitted. It is the only polling loop in the backend
and never spins: every round ends in an `Event.wait`. Waiting callers never
poll either: they wait on their `Handle`'s event, with a timeout.

A round: (0) the writes links submitted are posted, in order
(`requests.Requests`); (1) every posted transfer's state — DONE releases the
NIXL request, an error fails the transfer and severs its link; (2) every
live inbound link's notifications, handed to the handler through the kit's
`InboundLink.deliver` (never after a fence) and then acknowledged to its
sender in one `Acks` frame per link per round.

Deletion condition: a NIXL Python API exposing the UCX worker's event fd or
a completion callback; then this becomes a blocking wait.
"""

from __future__ import annotations

import logging
import threading

from ..control import LinkRegions
from .requests import Requests

log = logging.getLogger(__name__)

MIN_DELAY = 50e-6
MAX_DELAY = 2e-3
BUSY_MAX_DELAY = 0.5e-3  # while a send is in flight: its bytes move only when we call NIXL


class Progress:
    """The thread that drives one engine's NIXL agents."""

    def __init__(self, name: str, requests: Requests, links: LinkRegions) -> None:
        self._requests = requests
        self._links = links
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-progress {name}", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Run a round now (a write was submitted)."""
        self._wake.set()

    def stop(self, timeout: float) -> None:
        """Stop after the current round; waits at most `timeout` (a notify handler may block)."""
        self._stop = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = MIN_DELAY
        while not self._stop:
            try:
                worked, sending = self._round()
            except Exception:  # a bug here must not silently stop every transfer
                log.exception("nixl progress round failed")
                worked, sending = False, False
            cap = BUSY_MAX_DELAY if sending else MAX_DELAY
            delay = MIN_DELAY if worked else min(delay * 2, cap)
            self._wake.wait(delay)
            self._wake.clear()

    def _round(self) -> tuple[bool, bool]:
        refused, worked = self._requests.post()
        for link, seq, error in refused:
            link.post_refused(seq, error)
        failed, sending = self._requests.poll()
        for link, error in failed:
            worked = True
            link.sever(error)
        for peer in self._links.links():
            landed = peer.poll()
            if landed:
                worked = True
                peer.hand_over(landed)  # the kit's delivery rule, then one Acks frame
        return worked, sending
