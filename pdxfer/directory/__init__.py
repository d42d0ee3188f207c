"""Peers that find each other: a directory of which process holds which rank, and whether it lives.

Today a decode is told its prefill's `host:port`. A deployment of many
prefill and decode processes needs more: each rank registers where it is and
which incarnation it is (`PeerRecord`), a router picks a prefill instance from
the live ones, a decode resolves the instance's TP group, and everyone hears
when a peer goes ("down", within its lease's TTL) or comes back as a new
process ("replaced"). Three implementations, one contract
(`tests/directory/test_contract.py`):

- `LocalDirectory`: in-process, on a shared `LocalHub` (tests, one host);
- `StaticDirectory`: today's explicit addresses, fixed;
- `EtcdDirectory`: a real etcd — leases for liveness, list-then-watch.

The engines take a record wherever they took an address
(`DecodeEngine.expect(rid, record, ...)`, `HeteroTPDecode.expect(rid, group, ...)`)
and, given the directory (`DecodeEngine(pools, cfg, directory=d)`), refuse a
prefill whose layouts differ before dialing, refuse a Welcome from another
incarnation than the record's and re-resolve, and cut a replaced prefill's
links before dialing its successor. docs/directory.md is the deployment page.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

from .base import EVENTS, DirectoryEvent, DirectoryHealth, PeerDirectory, claim
from .errors import (
    DirectoryError,
    DirectoryUnavailable,
    RecordError,
    SlotTakenError,
)
from .etcd import EtcdDirectory
from .local import LocalDirectory, LocalHub, StaticDirectory
from .records import PeerRecord, Slot, engine_record


def open_directory(url: str, *, ttl: float = 10.0, follow: Iterable[tuple[str, str]] = (),
                   cluster: str | None = None) -> PeerDirectory:
    """A directory from a URL: `etcd://host:port[,host:port...]/<cluster>` or `local:`.

    `cluster` overrides the URL's path (default "default"). `local:` is an
    in-process directory of its own, for trying a launcher on one process.
    """
    if url == "local:":
        return LocalDirectory()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise DirectoryError(f"directory URL must be etcd://host:port[,host:port]/<cluster> or "
                             f"local:, got {url!r}")
    name = cluster or parts.path.strip("/") or "default"
    endpoints = [f"http://{hp}" for hp in parts.netloc.split(",")]
    return EtcdDirectory(endpoints, cluster=name, ttl=ttl, follow=follow)


__all__ = [
    "EVENTS",
    "DirectoryError",
    "DirectoryEvent",
    "DirectoryHealth",
    "DirectoryUnavailable",
    "EtcdDirectory",
    "LocalDirectory",
    "LocalHub",
    "PeerDirectory",
    "PeerRecord",
    "RecordError",
    "Slot",
    "SlotTakenError",
    "StaticDirectory",
    "claim",
    "engine_record",
    "open_directory",
]
