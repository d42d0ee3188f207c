"""The per-peer handshake: Hello/Welcome checks, and opening the data connection off-thread.

The control handshake is decided by two pure checks, one per side:
`hello_routes` (prefill: same transport, same pool layouts, routes for the
decode's regions — or the `Refusal` to send) and `welcome_mismatch`
(decode: the same layout check from its side). Then the prefill opens the
data connection:

Before a decode's requests can be posted, the prefill needs a transport
connection to it (`transport.connect`: a dial and the backend's own
handshake) and the decode's regions known to that connection (tcp asks the
peer for each region's length on its first write; nixl loads the peer's
metadata). Each of those is a network wait of up to the connect timeout, and
a stalled decode makes every one of them take that long. So they run here, in
a short-lived worker thread per peer, never on a caller's thread, never on
the progress thread and never under the request table's lock:

    Hello accepted ──► open(peer) ──► connect, one empty write per remote region,
                                      wait for them (bounded by connect_wait)
                   ◄── on_ready(peer, epoch, conn)   (on the progress thread)
                   ◄── on_failed(peer, epoch, error)

Reconnecting after a fence or a lost connection is the same call: `open`
with the dead connection, which the worker closes first (a close may wait for
the transport's threads, so it belongs here too). `epoch` names the attempt:
a result for an attempt the engine has since replaced is dropped by the
caller, so a slow old dial can never install itself over a newer one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pdxfer.transport.errors import CapabilityError, PeerLostError, ProtocolError

from .pools import PoolSet, Route, layout_error, mismatch, peer_routes
from .protocol import Hello, Welcome
from .workers import Workers

_EMPTY = np.empty((0, 3), dtype=np.int64)


class Refusal(Exception):
    """A Hello the prefill refuses; `kind` ("transport" | "layout") and `reason` go in `Refuse`."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def hello_routes(pools: PoolSet, transport: str, msg: Hello) -> dict[str, Route]:
    """The decode's routes, or `Refusal` (a mismatch) / `ProtocolError` (a malformed Hello)."""
    if msg.transport != transport:
        raise Refusal("transport", (
            f"decode uses transport {msg.transport!r}, this prefill {transport!r}; "
            "configure both with the same EngineConfig.transport"))
    try:
        reason = mismatch((pools.descs, pools.fingerprints), (msg.pools, msg.fingerprints))
        if reason is not None:
            raise Refusal("layout", reason)
        return peer_routes(pools, msg.pools, msg.buffers, msg.regions)
    except (AttributeError, TypeError, KeyError) as exc:
        raise ProtocolError(f"malformed hello: {exc}") from exc


def welcome_mismatch(pools: PoolSet, msg: Welcome) -> str | None:
    """Why the decode refuses the prefill's pools (None: they match), or `ProtocolError`."""
    try:
        return mismatch((msg.pools, msg.fingerprints), (pools.descs, pools.fingerprints))
    except (AttributeError, TypeError, KeyError) as exc:
        raise ProtocolError(f"malformed welcome: {exc}") from exc


def record_mismatch(pools: PoolSet, layouts: Mapping[str, str],
                    describe: Callable[[str], dict | None] | None) -> str | None:
    """Why the decode refuses a prefill by its directory record, before dialing (None: dial).

    `layouts` is the record's `{pool: fingerprint}`; `describe(fp)` the
    directory's published description (for a fingerprint that differs from
    ours, e.g. another TP split of the same format). Empty `layouts` (a bare
    address) or a differing fingerprint with no description leaves the
    decision to the handshake, as without a directory.
    """
    if not layouts:
        return None
    descs = {}
    for name, fp in layouts.items():
        desc = pools.descs.get(name) if pools.fingerprints.get(name) == fp else (
            describe(fp) if describe is not None else None)
        if desc is None:
            if name in pools.descs:
                return None  # cannot tell before dialing: the handshake decides
            desc = {}  # a pool we lack: `mismatch` names it from the names alone
        descs[name] = desc
    try:
        return mismatch((descs, dict(layouts)), (pools.descs, pools.fingerprints))
    except (AttributeError, TypeError, KeyError) as exc:
        return f"the directory's description of the prefill's pools is malformed: {exc}"


def why_lost(addr: str, refusal: tuple[str, str] | None, reason: str,
             reached: bool = True) -> tuple[str, BaseException]:
    """What a decode's requests fail with when its link to a prefill closes: a refusal, or a loss.

    `reached` is False when the prefill never welcomed this link (nothing
    listening, or gone before its Welcome): "lost" would send an operator
    looking for a crash of a prefill that was never there.
    """
    if refusal is not None and refusal[0] == "layout":
        error: BaseException = layout_error(refusal[1])
        return str(error), error
    if refusal is not None:
        return f"prefill at {addr} refused: {refusal[1]}", CapabilityError(refusal[1])
    reason = f"prefill at {addr} {'lost' if reached else 'not reached (no handshake)'}: {reason}"
    return reason, PeerLostError(reason)


class DataLinks(Workers):
    """Worker threads that (re)open data connections and close dead ones; joined on close
    (bounded: each is bounded by the connect wait)."""

    def __init__(self, transport: Any, wait: float, name: str,
                 on_ready: Callable[[Any, int, Any], None],
                 on_failed: Callable[[Any, int, BaseException], None]) -> None:
        super().__init__(name)
        self._transport = transport
        self._wait = wait
        self._on_ready = on_ready
        self._on_failed = on_failed

    def open(self, peer: Any, epoch: int, old: Any = None) -> None:
        """Start (re)opening `peer`'s data connection; `old`, if given, is closed first."""
        self._spawn(self._open, peer, epoch, old)

    def retire(self, conn: Any, then: Callable[[], None] | None = None) -> None:
        """Close `conn` off the caller's thread, then run `then` (e.g. post a callback)."""
        self._spawn(self._retire, conn, then)

    @staticmethod
    def _retire(conn: Any, then: Callable[[], None] | None) -> None:
        try:
            conn.close()
        finally:
            if then is not None:
                then()

    def _open(self, peer: Any, epoch: int, old: Any) -> None:
        until = time.monotonic() + self._wait
        conn = None
        try:
            if old is not None:
                old.close()  # the transport then dials afresh instead of handing it back
            conn = self._transport.connect(peer.address)
            # One empty (notify-less) write per remote region: tcp learns each
            # region's length now, so no later post waits for the peer.
            handles = [conn.write(region, remote, _EMPTY) for region, remote in peer.warm]
            for handle in handles:
                handle.wait(max(0.001, until - time.monotonic()))
        # Not only transport errors: a failed pinned allocation (RuntimeError,
        # MemoryError) or a backend bug must also end this attempt, or the
        # peer stays "opening" and no later request ever reopens it.
        except Exception as exc:  # noqa: BLE001 — reported to the engine, which fails the connect
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 — the attempt already failed; its first cause is kept
                    pass
            self._on_failed(peer, epoch, exc)
            return
        self._on_ready(peer, epoch, conn)
