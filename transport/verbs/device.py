"""The one device a verbs engine runs on, as its links see it: verbs, PD, port and the limits.

A narrow, frozen view handed to every link (`send.VerbsLink`,
`inbound.InboundPeer`) instead of the engine: the verbs namespace (real
pyverbs or the software fabric), the opened context and protection domain,
the port and the route its QPs' address vectors carry, the limits the
backend plans by, and the fence mode. Also here: the engine-wide MR
of a region (`LocalMR`, the region's child under "mr") and `local_key`,
which a write's source is resolved through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ClosedError
from .nics import Port, Route, needs_grh

MAX_RAILS = 16


@dataclass(frozen=True)
class Device:
    """What a link needs of its engine's device."""

    api: Any
    ctx: Any
    pd: Any
    port: Port
    route: Route
    sq_depth: int
    signal_every: int
    rails: int
    credits: int
    max_sge: int
    max_msg: int
    fence: str  # "mr": per-link MRs (a real fence); "qp": one shared MR per region (none)

    def path(self, lid: int, gid: str) -> dict[str, Any]:
        """The address-vector keywords of `build.connect_attr` for a peer known by `lid`/`gid`."""
        p, r = self.port, self.route
        return {"port_num": p.port_num, "lid": lid, "gid": gid, "sgid_index": p.gid_index,
                "grh": needs_grh(p, gid), "hop_limit": r.hop_limit, "traffic_class": r.traffic_class,
                "sl": r.sl}


class LocalMR:
    """A region's engine-wide MR (its child under "mr"): the lkey for SGEs, remote write under fence="qp"."""

    def __init__(self, mr: Any, base: int) -> None:
        self.mr, self.base = mr, base
        self.lkey = mr.lkey

    def close(self) -> None:
        self.mr.close()


def local_key(region: Any) -> tuple[int, int]:
    """`(lkey, base)` of a live local region's engine-wide MR."""
    found = region.child("mr")
    if found is None:
        raise ClosedError(f"verbs: region {region.region_id} is not registered")
    return found.lkey, found.base
