"""The host and network the software fabric models: NICs, GPUs, their PCIe places, subnets, routers.

Why a model of addressing at all: on a routed (L3, spine-leaf) RoCE v2
fabric a QP whose address vector names a link-local GID, a RoCE v1 GID, a
GID of another port, or a hop limit the path uses up, never hears back and
ends in `RETRY_EXC_ERR`; the same QP on one L2 segment works. A fabric that
delivered every packet by QP number would pass a backend that can only work
on one switch. So here:

* `Topology` declares the host: NICs (`SimNic`: name, PCIe path, NUMA node,
  ports) and GPUs (`SimGpu`: PCIe path, GPUDirect attributes), the subnets
  the ports are on, and routers joining subnets (`routers`: pairs).
* Each Ethernet port has the GID table an mlx5 port with one IPv4 address
  has: 0 and 1 link-local (`fe80::` + an interface id; RoCE v1 and v2),
  2 and 3 the IPv4-mapped address (`::ffff:a.b.c.d`; v1 and v2). An
  InfiniBand port has one GID (subnet prefix + port GUID) and a LID.
* `Network.delivers(src, dst)` says whether a packet sent by a QP with
  address vector `src.ah` from its port reaches the port `dst` sits on:
  the source GID must exist and the destination GID must be a GID of
  exactly that port, of the same type; crossing routers needs RoCE v2 (v1
  is L2), no link-local address on either end (routers never forward
  them) and a hop limit above the number of routers (each decrements it,
  the one that reaches zero drops the packet). InfiniBand without a GRH is
  routed by LID within one subnet. The NIC thread asks this both ways —
  requests out, ACKs back — and retries, then fails `RETRY_EXC_ERR`, as a
  requester that hears nothing does. (Simplified: when only the ACK path
  is broken, hardware may still place the bytes before the requester gives
  up; here nothing is placed. The transfer fails either way.)
* `write_sysfs(root)` writes the PCIe tree as sysfs shows it
  (`devices/pci0000:00/.../0000:03:00.0/numa_node`,
  `class/infiniband/<nic>/device`, `bus/pci/devices/<bus id>`), so the
  backend's `topology` reads a fake tree with its real code.

The default topology is one NIC, `soft0`, with one Ethernet port on
127.0.0.1: every engine of the process shares it, as on a loopback host.
"""

from __future__ import annotations

import collections
import ipaddress
import os
from dataclasses import dataclass, field

ROCE_V1, ROCE_V2 = 0, 1  # ibv_gid_type_sysfs values (IB GIDs report as v1)


@dataclass(frozen=True)
class SimPort:
    """One port: its subnet, and its IPv4 address (Ethernet) or LID (InfiniBand)."""

    subnet: str = "lan0"
    ipv4: str = "127.0.0.1"
    infiniband: bool = False
    lid: int = 0
    active: bool = True


@dataclass(frozen=True)
class SimNic:
    name: str
    pci: tuple[str, ...]  # sysfs path below devices/: root bus, bridges..., the NIC's bus id
    ports: tuple[SimPort, ...] = (SimPort(),)
    numa: int = 0


@dataclass(frozen=True)
class SimGpu:
    pci: tuple[str, ...]
    numa: int = 0
    writes_ordering: int = 0  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING (0: NONE, 100: OWNER)
    flush_options: int = 1  # ..._FLUSH_WRITES_OPTIONS (bit 0: cuFlushGPUDirectRDMAWrites)
    dmabuf: bool = True  # cuMemGetHandleForAddressRange works


@dataclass(frozen=True)
class Topology:
    nics: tuple[SimNic, ...] = (SimNic("soft0", ("pci0000:00", "0000:00:02.0", "0000:03:00.0")),)
    gpus: tuple[SimGpu, ...] = ()
    routers: tuple[tuple[str, str], ...] = ()  # each joins two subnets


@dataclass
class Ah:
    """A QP's address vector as the fabric holds it (set at RTR)."""

    is_global: bool = False
    dgid: str = ""
    sgid_index: int = 0
    hop_limit: int = 1
    traffic_class: int = 0
    dlid: int = 0
    sl: int = 0
    port_num: int = 1


@dataclass
class Gid:
    text: str
    kind: int  # ROCE_V1 / ROCE_V2

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.text)


def gid_text(addr: ipaddress.IPv6Address) -> str:
    """As pyverbs prints a GID: eight groups of four hex digits."""
    h = addr.packed.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


@dataclass
class PortState:
    nic: str
    num: int
    spec: SimPort
    gids: list[Gid] = field(default_factory=list)


class Network:
    """The ports, their GID tables and the routers between their subnets."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.ports: dict[tuple[str, int], PortState] = {}
        subnets = sorted({p.subnet for nic in topology.nics for p in nic.ports})
        for n, nic in enumerate(topology.nics):
            for p, spec in enumerate(nic.ports, start=1):
                state = PortState(nic.name, p, spec)
                guid = ipaddress.IPv6Address((0xFE80 << 112) | (0x0200_00FF_FE00_0000 + (n << 8) + p))
                if spec.infiniband:
                    # one subnet: the default fe80:: prefix; routed IB: a prefix per subnet
                    prefix = (0xFEC0 << 48 | subnets.index(spec.subnet)) if topology.routers else 0xFE80 << 48
                    state.gids.append(Gid(gid_text(ipaddress.IPv6Address(
                        (prefix << 64) | (int(guid) & (1 << 64) - 1))), ROCE_V1))
                else:
                    mapped = ipaddress.IPv6Address(f"::ffff:{spec.ipv4}")
                    state.gids += [Gid(gid_text(guid), ROCE_V1), Gid(gid_text(guid), ROCE_V2),
                                   Gid(gid_text(mapped), ROCE_V1), Gid(gid_text(mapped), ROCE_V2)]
                self.ports[(nic.name, p)] = state
        self._links: dict[str, set[str]] = collections.defaultdict(set)
        for a, b in topology.routers:
            self._links[a].add(b)
            self._links[b].add(a)

    def nic(self, name: str) -> SimNic | None:
        return next((n for n in self.topology.nics if n.name == name), None)

    def routers_between(self, a: str, b: str) -> int | None:
        """How many routers a packet crosses from subnet `a` to `b` (None: no path)."""
        seen, frontier, hops = {a}, [a], 0
        while frontier:
            if b in frontier:
                return hops
            nxt = [s for f in frontier for s in self._links[f] if s not in seen]
            seen.update(nxt)
            frontier, hops = nxt, hops + 1
        return None

    def delivers(self, src_port: tuple[str, int], ah: Ah, dst_port: tuple[str, int]) -> bool:
        """Whether a packet from `src_port` with address vector `ah` reaches `dst_port`."""
        src, dst = self.ports.get(src_port), self.ports.get(dst_port)
        if src is None or dst is None or not src.spec.active or not dst.spec.active:
            return False
        hops = self.routers_between(src.spec.subnet, dst.spec.subnet)
        if hops is None:
            return False
        if not ah.is_global:  # LID routing: InfiniBand, one subnet
            return src.spec.infiniband and hops == 0 and ah.dlid == dst.spec.lid
        if not 0 <= ah.sgid_index < len(src.gids):
            return False
        sgid = src.gids[ah.sgid_index]
        try:
            dgid = ipaddress.IPv6Address(ah.dgid)
        except ValueError:
            return False
        if not any(g.address == dgid and g.kind == sgid.kind for g in dst.gids):
            return False  # that GID (of that type) is not this port's: the packet goes elsewhere
        if hops == 0:
            return True
        if src.spec.infiniband:
            return ah.hop_limit > hops
        return (sgid.kind == ROCE_V2 and not sgid.address.is_link_local and not dgid.is_link_local
                and ah.hop_limit > hops)

    def write_sysfs(self, root: str) -> None:
        """The PCIe tree of the topology's NICs and GPUs as sysfs shows it, under `root`."""
        devices = os.path.join(root, "devices")
        places = [(nic.pci, nic.numa) for nic in self.topology.nics]
        places += [(gpu.pci, gpu.numa) for gpu in self.topology.gpus]
        for path, numa in places:
            for depth in range(1, len(path) + 1):
                d = os.path.join(devices, *path[:depth])
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "numa_node"), "w") as f:
                    f.write(f"{numa}\n")
            bus = os.path.join(root, "bus", "pci", "devices")
            os.makedirs(bus, exist_ok=True)
            link = os.path.join(bus, path[-1])
            if not os.path.lexists(link):
                os.symlink(os.path.join(devices, *path), link)
        for nic in self.topology.nics:
            d = os.path.join(root, "class", "infiniband", nic.name)
            os.makedirs(d, exist_ok=True)
            link = os.path.join(d, "device")
            if not os.path.lexists(link):
                os.symlink(os.path.join(devices, *nic.pci), link)
