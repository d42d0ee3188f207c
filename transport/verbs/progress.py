"""The verbs engine's one progress thread: it polls every link's CQ, flushes, and delivers notes.

One thread polls every outbound link's send CQ (completions free SQ slots,
which posts the next window) and every inbound link's CQ (notes). Never
`CompChannel.get_cq_event`: on rdma-core 44 it blocks holding the GIL. It
spins while completions come and backs off to `IDLE_POLL` when idle; a
link's `submit` kicks it.

Per round, the notes that arrived are delivered in three steps:

1. **visibility**: if the engine holds CUDA memory on a GPU that does not
   order NIC writes, `cuda.Flushes.flush()` makes every write placed so far
   visible to the GPU (`cuFlushGPUDirectRDMAWrites`) — once per round, for
   all links' notes together — before any notify of them runs;
2. **notify** and **ack**, through the kit's `ControlInbound.hand_over`:
   delivery by the kit's rule (never after a fence), on this thread and
   outside every link lock, so a handler may call `drop_peer`; then an ack
   with `block=False`, so the thread never waits on a sender's socket (acks
   the socket does not take now go on a later round, `flush_acks`).

The thread, its stop and wake-up and what happens when a round raises are
the kit's `loop_thread.LoopThread`: a round that raises ends the loop, logged
once, and the engine's `on_failure` fails every link at once
(`EngineBase.progress_failed`) instead of a traceback logged every round.

Nothing here takes the engine's locks or waits on a peer: one stalled
sender delays no other link's completions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..control import LinkRegions
from ..engine import Outbound
from ..errors import TransportError
from ..loop_thread import LoopThread
from .cuda import Flushes

log = logging.getLogger(__name__)
IDLE_POLL = 0.002  # longest sleep of an idle progress thread (s)
JOIN_TIMEOUT = 5.0


class Progress:
    """The thread that polls one engine's completion queues."""

    def __init__(self, name: str, outbound: Outbound, links: LinkRegions, flushes: Flushes,
                 on_failure: Callable[[TransportError], None] | None = None) -> None:
        """`on_failure(error)`: a round raised and the loop ended (`LoopThread`)."""
        self._outbound, self._links, self._flushes = outbound, links, flushes
        self._idle = 0
        self._loop = LoopThread(f"verbs-progress {name}", self._turn, on_failure=on_failure)

    def kick(self) -> None:
        self._loop.kick()

    def stop(self) -> bool:
        """Stop and join (bounded); False if the thread is still busy (a notify handler is stuck)."""
        return self._loop.stop(JOIN_TIMEOUT)

    def _turn(self) -> float:
        if self._round():
            self._idle = 0
            return 0.0  # completions are coming: poll again at once
        self._idle += 1
        return min(IDLE_POLL, 2e-5 * self._idle)

    def _round(self) -> bool:
        busy = False
        for link in self._outbound.links():
            busy |= link.poll()
        arrived = []
        for peer in self._links.links():
            if peer.unacked:
                peer.flush_acks()
            notes = peer.poll()
            if notes:
                arrived.append((peer, notes))
        if not arrived:
            return busy
        if self._flushes:
            try:
                self._flushes.flush()
            except TransportError as exc:  # the bytes cannot be made visible: fail these links
                log.error("verbs: flushing GPUDirect RDMA writes failed (%s); dropping the links "
                          "whose notes arrived", exc)
                for peer, _ in arrived:
                    peer.fence()
                return True
        for peer, notes in arrived:
            peer.hand_over(notes, block=False)  # the kit's delivery rule, then an ack that never waits
        return True
