"""Bootstrap host names, resolved off the progress thread; the address family from the answer.

A decode dials each prefill at the address its router handed over, often a
host name (a Kubernetes service, a pod's DNS name). `getaddrinfo` on a name
can take seconds — a slow or unreachable DNS server — and cannot be
cancelled, so it never runs on the engine's one progress thread, where it
would stop every heartbeat, poll and notify of every other peer meanwhile.
A literal address is parsed in place (`numeric`: `AI_NUMERICHOST`, no
network); a name goes to a short-lived worker thread (`Lookups`), whose
answer the caller posts back to its progress thread.

The family (IPv4 or IPv6) is whatever `getaddrinfo` answers — `localhost`
may be `::1` only — never guessed from the spelling.

The bound is the caller's: the decode stops waiting for an answer at the
end of its connect window and drops one that comes later (`decode_dials.py`).
A lookup stuck inside the system resolver cannot be ended by anything;
`close` joins each worker for a bounded time and leaves such a one behind as
a daemon thread — the one deliberate exception to "close joins what it
started", since the alternative is a close that does not return.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from .workers import Workers

# (family, sockaddr) pairs, in the resolver's order of preference.
Addrs = list[tuple[int, Any]]


def _pairs(infos: list) -> Addrs:
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


def numeric(host: str, port: int) -> Addrs | None:
    """`host` as an address if it is a literal one (no lookup, so safe anywhere), else None."""
    try:
        return _pairs(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                         flags=socket.AI_NUMERICHOST))
    except (socket.gaierror, UnicodeError):
        return None


def resolve_blocking(host: str, port: int, flags: int = 0) -> Addrs:
    """`getaddrinfo` for a stream socket; raises `OSError` (`gaierror`). For threads that may block."""
    return _pairs(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags))


class Lookups(Workers):
    """One worker thread per name lookup; `on_done(key, addrs, error)` runs on that thread."""

    def __init__(self, name: str, on_done: Callable[[Any, Addrs | None, BaseException | None], None]) -> None:
        super().__init__(name)
        self._on_done = on_done

    def start(self, key: Any, host: str, port: int) -> None:
        """Resolve `host` in the background; nothing happens after `close`."""
        self._spawn(self._run, key, host, port)

    def _run(self, key: Any, host: str, port: int) -> None:
        try:
            addrs, error = resolve_blocking(host, port), None
        except Exception as exc:  # noqa: BLE001 — any failure is this lookup's answer
            addrs, error = None, exc
        self._on_done(key, addrs, error)
