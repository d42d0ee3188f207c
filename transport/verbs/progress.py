"""The verbs engine's one progress thread: it polls every link's CQ and delivers notes.

One thread polls every outbound link's send CQ (completions free SQ slots,
which posts the next window) and every inbound link's CQ (notes: delivered
through the kit's `InboundLink.deliver` — never after a fence — then
acknowledged). Never `CompChannel.get_cq_event`: on rdma-core 44 it blocks
holding the GIL. It spins while completions come and backs off to
`IDLE_POLL` when idle; a link's `submit` kicks it. Notify handlers run on
it, outside every link lock, so a handler may call `drop_peer`.
"""

from __future__ import annotations

import logging
import threading

from ..control import LinkRegions
from ..engine import Outbound

log = logging.getLogger(__name__)
IDLE_POLL = 0.002  # longest sleep of an idle progress thread (s)
JOIN_TIMEOUT = 5.0


class Progress:
    """The thread that polls one engine's completion queues."""

    def __init__(self, name: str, outbound: Outbound, links: LinkRegions) -> None:
        self._outbound, self._links = outbound, links
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"verbs-progress {name}")
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def stop(self) -> bool:
        """Stop and join (bounded); False if the thread is still busy (a notify handler is stuck)."""
        self._stop = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(JOIN_TIMEOUT)
        return not self._thread.is_alive()

    def _run(self) -> None:
        idle = 0
        while not self._stop:
            try:
                busy = self._round()
            except Exception:  # a bug here must not silently stop every transfer
                log.exception("verbs progress round failed")
                busy = False
            if busy:
                idle = 0
                continue
            idle += 1
            self._wake.wait(min(IDLE_POLL, 2e-5 * idle))
            self._wake.clear()

    def _round(self) -> bool:
        busy = False
        for link in self._outbound.links():
            busy |= link.poll()
        for peer in self._links.links():
            notes = peer.poll()
            if notes:
                busy = True
                peer.hand_over(notes)  # the kit's delivery rule, then one Acks frame
        return busy
