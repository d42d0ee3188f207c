"""Request lifecycles as pure state machines (a package: effects, prefill, decode): what a request may do next, and what that costs.

A request's state used to be a dozen flags (`failing`, `cut`, `ack`,
`last_sent`, `aborting`, ...) set by a dozen handlers; every fault in the
control plane was two of them disagreeing. Here each side's request is ONE
object with ONE phase enum, and every event is a method (`on_send`,
`on_expect`, `on_landed`, `on_done`, `on_abort`, `on_link_lost`,
`on_tick` for deadlines, `on_close`) that moves the phase and returns the
*effects* the driver must carry out: `Post` a chunk, `Send` a control
message, `Cut` the data connection, `Fence` the peer, `Quarantine` a failed
request the transport cannot fence, `Finish` the request.

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
that ends them, before it finishes. Where the transport cannot fence, the
decode waits instead for the prefill's word (its Abort/AbortAck, sent only
once nothing of the request is in flight there) or for the prefill to be
gone; meanwhile the request is Quarantined.
"""

from __future__ import annotations

from .decode import DecodeLife, DPhase
from .effects import Cut, Fence, Finish, Post, Quarantine, Send, Timing
from .prefill import PPhase, PrefillLife

__all__ = ["Cut", "DPhase", "DecodeLife", "Fence", "Finish", "PPhase", "Post", "PrefillLife",
           "Quarantine", "Send", "Timing"]
