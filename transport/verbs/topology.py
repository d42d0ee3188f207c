"""How far a NIC is from a GPU, read from the PCIe tree in sysfs, as NCCL and UCX read it.

Why: on an 8-GPU/8-NIC node each GPU sits under a PCIe switch with "its"
NIC. GPUDirect RDMA between a GPU and a NIC under the same switch stays on
that switch; through another NIC it crosses the CPU's root complex (or the
socket interconnect), which costs bandwidth and is shared by every rank that
makes the same mistake. So an engine whose memory is on a GPU takes the NIC
nearest to it.

The distance is the path between the two devices in the PCI hierarchy, named
with the classes `nvidia-smi topo -m` and NCCL use (NCCL's
`src/graph/topo.cc`/`paths.cc`, UCX's `ucs/sys/topo`):

    PIX   at most one PCIe bridge between them (the same switch)
    PXB   several bridges, but not the host bridge
    PHB   through the PCIe host bridge (the same root complex, usually a CPU)
    NODE  through the interconnect between root complexes of one NUMA node
    SYS   through the interconnect between NUMA nodes

Read from sysfs: a device's place is the real path of
`class/infiniband/<nic>/device` or `bus/pci/devices/<bus id>`, below
`devices/` (`pci0000:16/0000:16:02.0/0000:17:00.0`: root complex, bridges,
device), and its NUMA node from `numa_node`. `root` is "/sys" on a host and a
fake tree in tests (the software fabric writes one for the hosts it models),
so the same code is what the tests exercise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass(frozen=True)
class PciPlace:
    """Where a device sits: its path of PCI components below `devices/`, and its NUMA node."""

    path: tuple[str, ...]
    numa: int


@dataclass(frozen=True, order=True)
class Distance:
    """The path between two devices: its class (index into CLASSES), then the PCI links it crosses."""

    rank: int
    hops: int

    @property
    def name(self) -> str:
        return CLASSES[self.rank]


def place(root: str, link: str) -> PciPlace | None:
    """The place of the device that `root/link` points to, or None if sysfs does not say."""
    devices = os.path.realpath(os.path.join(root, "devices"))
    real = os.path.realpath(os.path.join(root, link))
    if not real.startswith(devices + os.sep):
        return None
    path = tuple(real[len(devices) + 1:].split(os.sep))
    if not path or not path[0].startswith("pci"):
        return None
    try:
        with open(os.path.join(real, "numa_node")) as f:
            numa = int(f.read().strip() or -1)
    except (OSError, ValueError):
        numa = -1
    return PciPlace(path, numa)


def nic_place(root: str, nic: str) -> PciPlace | None:
    """Where RDMA device `nic` (e.g. "mlx5_3") sits."""
    return place(root, os.path.join("class", "infiniband", nic, "device"))


def gpu_place(root: str, bus_id: str) -> PciPlace | None:
    """Where the GPU with PCI bus id `bus_id` ("0000:18:00.0", as cuDeviceGetPCIBusId says) sits."""
    return place(root, os.path.join("bus", "pci", "devices", bus_id.lower()))


def distance(a: PciPlace, b: PciPlace) -> Distance:
    """The class of the path between `a` and `b`, and how many PCI links it crosses.

    `path[0]` is the root bus (the host bridge), `path[1]` a root port, and
    each further component a bridge (a switch's upstream or downstream port)
    until the device itself. Two devices meeting below a root port meet
    inside a switch: PIX when each hangs one downstream port below the
    meeting point (one switch crossed), PXB when either is further down.
    """
    hops = len(a.path) + len(b.path)
    if a.path[0] != b.path[0]:  # different root complexes
        same_node = a.numa == b.numa or a.numa < 0 or b.numa < 0
        return Distance(CLASSES.index("NODE" if same_node else "SYS"), hops)
    common = 0
    for x, y in zip(a.path, b.path, strict=False):
        if x != y:
            break
        common += 1
    hops -= 2 * common
    if common == 1:
        return Distance(CLASSES.index("PHB"), hops)
    if common >= 3 and len(a.path) - common <= 2 and len(b.path) - common <= 2:
        return Distance(CLASSES.index("PIX"), hops)
    return Distance(CLASSES.index("PXB"), hops)
