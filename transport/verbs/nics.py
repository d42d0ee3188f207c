"""Which RDMA port an engine uses, and how its QPs address a peer's: devices, ports, GIDs, routes.

What a real fabric needs, each fact computed here once:

* **The ports there are** (`scan`): every ACTIVE port of every device (or
  of the one pinned with `device=`/`port_num=`), with its GID table, limits
  and place in the PCIe tree (`topology`).
* **Which one** (`choose_port`): an engine whose memory is on a GPU takes
  the port nearest to that GPU (`topology.distance`, as NCCL and UCX do:
  on an 8-GPU/8-NIC node every rank gets its own NIC instead of all sharing
  the first); otherwise the port that holds the address the engine's
  control listener binds; otherwise the first ACTIVE one. The reason goes
  into `Port.why`, which the engine's description and log line carry.
* **Which GID** (`choose_gid`). RoCE: a RoCE v2 GID (v1 is L2 only), the
  one equal to the bound address if the port holds it (the IPv4-mapped
  `::ffff:a.b.c.d` for an IPv4 host); else one of the host's address family
  that is not link-local; link-local (`fe80::/10`) GIDs only as a last
  resort, since no router forwards them — the first RoCE v2 GID of a
  standard mlx5 table is exactly such a one. NCCL's `ncclIbGetGidIndex`
  picks the same way (configured, not link-local, RoCE v2, address family).
  InfiniBand: GID index 0 and the port's LID; a peer on another subnet
  (another GID prefix) is reached through the GRH (`needs_grh`).
* **How packets travel** (`Route`): `hop_limit` (64, the IPv6 default; the
  packet is dropped by the router that counts it down to zero, and pyverbs'
  own default of 1 dies at the first router), `traffic_class` (the DSCP/ECN
  byte a lossless RoCE class is selected by), `sl` (the InfiniBand service
  level, or the RoCE priority on some NICs). `gid_index=` pins the GID.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import pdxfer.transport.verbs.topology as topology  # absolute: `from . import` depends on verbs/__init__

from ..errors import CapabilityError, ProtocolError
from .api import load

log = logging.getLogger(__name__)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Gid:
    """One entry of a port's GID table."""

    index: int
    text: str  # as pyverbs writes it: eight groups of four hex digits
    roce_v2: bool  # Ethernet: RoCE v2 (UDP/IP, routable); False: RoCE v1 (L2 only) or InfiniBand

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.text)

    @property
    def zero(self) -> bool:
        return self.address == ipaddress.IPv6Address(0)

    @property
    def link_local(self) -> bool:
        return self.address.is_link_local

    def holds(self, ip: IPAddress) -> bool:
        """Whether this GID is address `ip` (IPv4 as its IPv4-mapped form)."""
        mapped = ip if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}")
        return self.address == mapped

    @property
    def family(self) -> int:
        return 4 if self.address.ipv4_mapped is not None else 6


@dataclass(frozen=True)
class PortInfo:
    """An ACTIVE port as `scan` found it."""

    device: str
    port_num: int
    ethernet: bool
    lid: int
    mtu: int  # ibv_mtu enum value
    gids: tuple[Gid, ...]
    max_qp_wr: int
    max_sge: int
    max_cqe: int
    max_msg_sz: int
    place: topology.PciPlace | None

    def holds(self, ip: IPAddress | None) -> bool:
        return ip is not None and any(g.holds(ip) for g in self.gids)


@dataclass(frozen=True)
class Port:
    """The port a verbs engine uses and the GID it is known by, with the limits it plans by."""

    device: str
    port_num: int
    gid_index: int
    gid: str
    lid: int
    mtu: int  # ibv_mtu enum value
    ethernet: bool
    max_qp_wr: int
    max_sge: int
    max_cqe: int
    max_msg_sz: int
    why: str = ""  # how the port and GID were chosen (the engine's description says it)


@dataclass(frozen=True)
class Route:
    """How this engine's packets travel: the GRH hop limit and traffic class, and the service level."""

    hop_limit: int = 64
    traffic_class: int = 0
    sl: int = 0

    @classmethod
    def checked(cls, hop_limit: Any, traffic_class: Any, sl: Any) -> Route:
        """A route from options, or `CapabilityError` naming the bad one and its range."""
        for name, value, lo, hi in (("hop_limit", hop_limit, 1, 255), ("traffic_class", traffic_class, 0, 255),
                                    ("sl", sl, 0, 15)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise CapabilityError(f"verbs option {name} must be an int in {lo}..{hi}, got {value!r}")
        return cls(hop_limit, traffic_class, sl)


def needs_grh(port: Port, peer_gid: str) -> bool:
    """Whether packets to `peer_gid` need a GRH: always on RoCE; on InfiniBand across subnets."""
    try:
        peer = ipaddress.IPv6Address(peer_gid)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"the peer's GID {peer_gid!r} is not a GID (eight groups of hex digits)") from exc
    return port.ethernet or peer.packed[:8] != ipaddress.IPv6Address(port.gid).packed[:8]


def no_devices_reason(exc: BaseException | None) -> str:
    """Why no RDMA device is usable here, in words."""
    if not os.path.isdir("/sys/class/infiniband"):
        return "no RDMA device: kernel has no InfiniBand support (/sys/class/infiniband is absent)"
    return f"no RDMA device found ({exc or 'ibv_get_device_list returned none'})"


def bound_address(host: str) -> IPAddress | None:
    """The address a listener on `host` binds, or None for a wildcard or a name that does not resolve.

    Called at engine construction, on the caller's thread (a host name resolves here once).
    """
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError, IndexError):
            return None
    return None if ip.is_unspecified else ip


# -- finding the ports ----------------------------------------------------------------

def scan(api: Any, device: str | None = None, port_num: int | None = None,
         sysfs: str = "/sys") -> tuple[list[PortInfo], list[str]]:
    """Every ACTIVE port (of `device`/`port_num` if pinned): `(ports, why others were skipped)`."""
    E = api.E
    try:
        devices = api.get_device_list()
    except api.PyverbsError as exc:
        raise CapabilityError(no_devices_reason(exc)) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in devices]
    if device is not None:
        names = [n for n in names if n == device] or [device]
    if not names:
        raise CapabilityError(no_devices_reason(None))
    found, skipped = [], []
    for name in names:
        try:
            ctx = api.Context(name=name)
        except api.PyverbsError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        try:
            attr_dev = ctx.query_device()
            for p in [port_num] if port_num else [1, 2]:
                try:
                    attr = ctx.query_port(p)
                except api.PyverbsError:
                    continue
                if attr.state != E.ibv_port_state.IBV_PORT_ACTIVE:
                    skipped.append(f"{name} port {p}: not active")
                    continue
                found.append(PortInfo(
                    name, p, attr.link_layer == E.IBV_LINK_LAYER_ETHERNET, int(attr.lid),
                    int(attr.active_mtu), _gids(api, ctx, p, int(attr.gid_tbl_len)),
                    int(attr_dev.max_qp_wr), int(attr_dev.max_sge), int(attr_dev.max_cqe),
                    int(attr.max_msg_sz), topology.nic_place(sysfs, name)))
        finally:
            ctx.close()
    return found, skipped


def _gids(api: Any, ctx: Any, port: int, count: int) -> tuple[Gid, ...]:
    v2 = api.E.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2
    out = []
    for i in range(count):
        try:
            gid = Gid(i, ctx.query_gid(port, i).gid, ctx.query_gid_type(port, i) == v2)
        except (api.PyverbsError, ValueError):  # an unpopulated entry
            continue
        if not gid.zero:
            out.append(gid)
    return tuple(out)


# -- choosing ---------------------------------------------------------------------------

def choose_port(ports: list[PortInfo], *, host: IPAddress | None,
                gpu: tuple[str, topology.PciPlace | None] | None = None,
                pinned: bool = False) -> tuple[PortInfo, str]:
    """The port to use and why: nearest to the GPU, else holding the bound address, else the first."""
    if pinned:
        return ports[0], "pinned by the device=/port_num= options"
    if gpu is not None:
        name, where = gpu
        ranked = [(topology.distance(p.place, where), not p.holds(host), i)
                  for i, p in enumerate(ports) if p.place is not None and where is not None]
        if ranked:
            dist, _, i = min(ranked)
            return ports[i], f"nearest to {name} ({dist.name}, {dist.hops} PCI links)"
        log.warning("verbs: no PCIe placement of %s or of the NICs in sysfs; the NIC is not chosen by "
                    "topology (pin one with device=)", name)
    for p in ports:
        if p.holds(host):
            return p, f"holds the bound address {host}"
    return ports[0], "the first ACTIVE port" if len(ports) > 1 else "the only ACTIVE port"


def choose_gid(port: PortInfo, host: IPAddress | None, pinned: int | None = None) -> tuple[Gid, str]:
    """The GID this engine is known by on `port`, and why (see the module docstring)."""
    if pinned is not None:
        for g in port.gids:
            if g.index == pinned:
                return g, "pinned by gid_index"
        raise CapabilityError(f"gid_index={pinned}: port {port.port_num} of {port.device} has no GID "
                              f"there (populated: {[g.index for g in port.gids]})")
    if not port.ethernet:
        if not port.gids or port.gids[0].index != 0:
            raise CapabilityError(f"InfiniBand port {port.port_num} of {port.device} has no GID 0")
        return port.gids[0], "InfiniBand: GID 0, LID routing within the subnet"
    v2 = [g for g in port.gids if g.roce_v2]
    if not v2:
        raise CapabilityError(f"port {port.port_num} of {port.device} has no RoCE v2 GID; configure an "
                              "IP address on its netdev, or pass gid_index=")
    if host is not None:
        for g in v2:
            if g.holds(host):
                return g, f"RoCE v2, the bound address {host}"
    family = host.version if host is not None else 4
    routable = [g for g in v2 if not g.link_local]
    for g in routable:
        if g.family == family:
            return g, f"RoCE v2, the port's first IPv{family} address"
    if routable:
        return routable[0], "RoCE v2, the port's first routable address"
    log.warning("verbs: port %s/%d has only link-local RoCE v2 GIDs: peers behind a router cannot be "
                "reached (configure an address, or pass gid_index=)", port.device, port.port_num)
    return v2[0], "RoCE v2, link-local (not routable)"


def open_port(api: Any, info: PortInfo, gid: Gid, why: str) -> tuple[Any, Port]:
    """Open the chosen device: `(Context, Port)`."""
    try:
        ctx = api.Context(name=info.device)
    except api.PyverbsError as exc:
        raise CapabilityError(f"cannot open RDMA device {info.device}: {exc}") from exc
    return ctx, Port(info.device, info.port_num, gid.index, gid.text, info.lid, info.mtu, info.ethernet,
                     info.max_qp_wr, info.max_sge, info.max_cqe, info.max_msg_sz, why)


def pick_port(api: Any, device: str | None = None, port_num: int | None = None,
              gid_index: int | None = None, host: str = "127.0.0.1") -> tuple[Any, Port]:
    """Scan, choose (no GPU) and open in one step: `(Context, Port)` (tests, the probe)."""
    ports, skipped = scan(api, device, port_num)
    if not ports:
        raise CapabilityError(f"no ACTIVE RDMA port ({'; '.join(skipped) or 'none found'}); "
                              "bring a link up or pin device=/port_num=")
    ip = bound_address(host)
    info, why = choose_port(ports, host=ip, pinned=device is not None)
    gid, gwhy = choose_gid(info, ip, gid_index)
    return open_port(api, info, gid, f"{why}; GID {gid.index} {gwhy}")


def probe() -> str | None:
    """None when real pyverbs imports and an ACTIVE port exists, else the reason it does not."""
    if not os.path.isdir("/sys/class/infiniband"):  # no kernel RDMA: say so, import nothing
        return no_devices_reason(None)
    try:
        ctx, _ = pick_port(load())
    except CapabilityError as exc:
        return str(exc)
    ctx.close()
    return None
