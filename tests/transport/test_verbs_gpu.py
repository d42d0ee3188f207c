"""Verbs with GPU memory on the software fabric: NIC per GPU, dma-buf lifetime, the flush before notify.

There is no GPU here: "GPU memory" is the fabric's CUDA double (`sim/gpu.py`), host pages
mapped into a per-GPU address window that the backend asks about through the same calls
it makes of libcuda (`locate`, `export`, `bus_id`, `flush_needed`, `flush`). The host is a
two-socket box with a PCIe switch per socket, each holding one GPU and one NIC, and a fake
sysfs tree of it (`net.write_sysfs`) that the backend's real topology code reads.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError
from pdxfer.transport.verbs import sim, topology
from pdxfer.transport.verbs.sim.net import SimGpu, SimNic, SimPort, Topology

from pdxfer import transport

WAIT = 10.0
S0, S1 = ("pci0000:00", "0000:00:01.0", "0000:01:00.0"), ("pci0000:80", "0000:80:01.0", "0000:81:00.0")
TWO = Topology(  # socket 0: switch 0000:01 with soft0 and GPU 0; socket 1: switch 0000:81 with soft1, GPU 1
    nics=(SimNic("soft0", (*S0, "0000:02:00.0", "0000:03:00.0"), (SimPort("lan0", "127.0.0.11"),)),
          SimNic("soft1", (*S1, "0000:82:00.0", "0000:83:00.0"), (SimPort("lan0", "127.0.0.12"),), numa=1)),
    gpus=(SimGpu((*S0, "0000:02:04.0", "0000:04:00.0")),
          SimGpu((*S1, "0000:82:04.0", "0000:84:00.0"), numa=1)))
ONE = Topology(gpus=(SimGpu(("pci0000:00", "0000:00:01.0", "0000:05:00.0")),))


def _table(n: int) -> np.ndarray:
    return np.array([[0, 0, n]], np.int64)


# -- which NIC ---------------------------------------------------------------------------

def test_each_gpus_pool_takes_the_nic_under_its_own_switch() -> None:
    with sim.use(sim.Fabric(TWO)) as fab:
        e1, e0, host = (transport.create("verbs-sim") for _ in range(3))
        try:
            src = fab.cuda.alloc(1, 1 << 20)  # GPU 1 first: "the first ACTIVE port" would be soft0
            src.copy_(torch.from_numpy(np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)))
            dst = fab.cuda.alloc(0, 1 << 20)
            assert e1.nic is None and "NIC not chosen yet" in e1.describe()
            a, b = e1.register(src), e0.register(dst)
            assert e1.nic.device == "soft1" and "nearest to cuda:1 (PIX" in e1.nic.why
            assert e0.nic.device == "soft0" and "nearest to cuda:0 (PIX" in e0.nic.why
            assert "on soft1 port 1" in repr(e1)
            host.register(torch.zeros(64, dtype=torch.uint8))
            assert host.nic.device == "soft0" and host.nic.why.startswith("the first ACTIVE port")
            # GPU 1 -> GPU 0, NIC to NIC, through dma-buf MRs on both sides
            e1.connect(e0.address()).write(a, b.descriptor(), _table(1 << 20), notify=b"x").wait(WAIT)
            assert torch.equal(dst, src)
        finally:
            for e in (e1, e0, host):
                e.close()


def test_a_pinned_device_wins_and_memory_far_from_the_chosen_nic_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    with sim.use(sim.Fabric(TWO)) as fab:
        pinned, late = transport.create("verbs-sim", device="soft0"), transport.create("verbs-sim")
        try:
            pinned.register(fab.cuda.alloc(1, 4096))
            assert pinned.nic.device == "soft0" and pinned.nic.why.startswith("pinned")
            late.register(torch.zeros(64, dtype=torch.uint8))  # host memory first: soft0
            with caplog.at_level(logging.WARNING):
                late.register(fab.cuda.alloc(1, 4096))
            assert "cuda:1 memory goes through soft0/1" in caplog.text and "soft1/1 is nearest" in caplog.text
        finally:
            pinned.close()
            late.close()


def test_pcie_distance_classes() -> None:
    def at(*path: str, numa: int = 0) -> topology.PciPlace:
        return topology.PciPlace(path, numa)

    gpu = at(*S0, "0000:02:04.0", "0000:04:00.0")
    assert topology.distance(gpu, at(*S0, "0000:02:00.0", "0000:03:00.0")).name == "PIX"
    assert topology.distance(gpu, at(*S0, "0000:02:08.0", "0000:06:00.0", "0000:07:00.0")).name == "PXB"
    assert topology.distance(gpu, at("pci0000:00", "0000:00:02.0", "0000:09:00.0")).name == "PHB"
    assert topology.distance(gpu, at("pci0000:40", "0000:40:01.0", "0000:41:00.0")).name == "NODE"
    assert topology.distance(gpu, at("pci0000:80", "0000:80:01.0", "0000:81:00.0", numa=1)).name == "SYS"


def test_the_fake_sysfs_is_read_by_the_real_topology_code() -> None:
    with sim.use(sim.Fabric(TWO)) as fab:
        nic = topology.nic_place(fab.sysfs, "soft1")
        gpu = topology.gpu_place(fab.sysfs, fab.cuda.bus_id(1))
        assert nic == topology.PciPlace((*S1, "0000:82:00.0", "0000:83:00.0"), 1)
        assert os.path.islink(os.path.join(fab.sysfs, "class", "infiniband", "soft1", "device"))
        assert topology.distance(nic, gpu).name == "PIX"
        assert topology.nic_place(fab.sysfs, "mlx5_9") is None


# -- memory lifetime ------------------------------------------------------------------------

def test_free_and_reallocate_at_the_same_address_registers_the_new_pages() -> None:
    with sim.use(sim.Fabric(ONE)) as fab:
        tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim")
        try:
            src = torch.from_numpy(np.random.default_rng(3).integers(1, 256, 1 << 16, dtype=np.uint8))
            a = tx.register(src)
            conn = tx.connect(rx.address())
            old = fab.cuda.alloc(0, 1 << 16)
            first = rx.register(old)
            fd = first.child("cuda").export.fd
            conn.write(a, first.descriptor(), _table(1 << 16)).wait(WAIT)
            assert torch.equal(old, src)
            rx.deregister(first)
            with pytest.raises(OSError):  # the export went with the region
                os.fstat(fd)
            address = fab.cuda.free(old)
            new = fab.cuda.alloc(0, 1 << 16, at=address)  # the allocator hands the address out again
            assert new.data_ptr() == address and not new.any()
            second = rx.register(new)
            conn.write(a, second.descriptor(), _table(1 << 16)).wait(WAIT)
            assert torch.equal(new, src), "the region was registered against the freed allocation's pages"
        finally:
            tx.close()
            rx.close()


def test_regions_of_one_allocation_share_its_export_and_nothing_outlives_deregister() -> None:
    with sim.use(sim.Fabric(ONE)) as fab:
        tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim")
        try:
            tx.connect(rx.address())  # a live inbound link: every region also gets a per-link MR
            whole = fab.cuda.alloc(0, 1 << 16)
            halves = [rx.register(whole[:1 << 15]), rx.register(whole[1 << 15:])]
            fds = {h.child("cuda").export.fd for h in halves}
            assert len(fds) == 1 and fab.cuda.exported == 1
            keys = {k for k, m in fab.mrs.items() if m.gpu is not None}
            assert len(keys) == 4  # two regions x (engine MR + the link's MR)
            rx.deregister(halves[0])
            os.fstat(fds.copy().pop())  # still held by the other half
            watch = weakref.ref(halves[1].data)
            rx.deregister(halves[1])
            with pytest.raises(OSError):
                os.fstat(fds.pop())
            assert not keys & set(fab.mrs), "an MR over a deregistered region is still live"
            del halves
            gc.collect()
            assert watch() is None, "something still references a deregistered region's tensor"
        finally:
            tx.close()
            rx.close()


def test_gpu_memory_without_dmabuf_or_peermem_is_refused_naming_both() -> None:
    if os.path.isdir("/sys/module/nvidia_peermem"):
        pytest.skip("nvidia-peermem is loaded here: registration would fall back to it")
    nodmabuf = Topology(gpus=(SimGpu(("pci0000:00", "0000:00:01.0", "0000:05:00.0"), dmabuf=False),))
    with sim.use(sim.Fabric(nodmabuf)) as fab:
        with transport.create("verbs-sim") as rx:
            with pytest.raises(CapabilityError, match=r"dma-buf MR failed \(.*CUresult 801.*\) and the "
                                                      r"nvidia-peermem module is not loaded"):
                rx.register(fab.cuda.alloc(0, 4096))
            assert rx.regions.live() == []


# -- visibility -------------------------------------------------------------------------------

def _notify_sees(topo: Topology) -> tuple[list, int]:
    """Writes into GPU memory; what each notify saw: (unflushed packets, bytes right); flushes made."""
    with sim.use(sim.Fabric(topo)) as fab:
        tx, rx = transport.create("verbs-sim"), transport.create("verbs-sim")
        seen: list = []
        try:
            src = torch.from_numpy(np.random.default_rng(4).integers(1, 256, 1 << 20, dtype=np.uint8))
            dst = fab.cuda.alloc(0, 1 << 20)
            a, b = tx.register(src), rx.register(dst)
            rx.set_notify_handler(lambda sender, payload: seen.append(
                (fab.cuda.unflushed(0), bool(torch.equal(dst, src)))))
            conn = tx.connect(rx.address())
            for _ in range(3):
                dst.zero_()
                conn.write(a, b.descriptor(), _table(1 << 20), notify=b"n").wait(WAIT)
            return seen, fab.cuda.flushes[0]
        finally:
            tx.close()
            rx.close()


def test_gpudirect_writes_are_flushed_before_the_notify_runs() -> None:
    seen, flushes = _notify_sees(ONE)  # writes_ordering NONE: cuFlushGPUDirectRDMAWrites needed
    assert seen == [(0, True)] * 3, "a notify ran while NIC writes were not yet flushed to the GPU"
    assert flushes >= 3


def test_a_gpu_that_orders_nic_writes_is_never_flushed() -> None:
    ordered = Topology(gpus=(SimGpu(ONE.gpus[0].pci, writes_ordering=100),))  # OWNER (Hopper and later)
    seen, flushes = _notify_sees(ordered)
    assert seen == [(0, True)] * 3 and flushes == 0


def test_a_gpu_that_can_neither_order_nor_flush_is_refused() -> None:
    blind = Topology(gpus=(SimGpu(ONE.gpus[0].pci, flush_options=0),))
    with sim.use(sim.Fabric(blind)) as fab, transport.create("verbs-sim") as rx:
        with pytest.raises(CapabilityError, match=r"GPU 0 neither orders GPUDirect RDMA writes "
                                                  r"\(WRITES_ORDERING=0\) nor offers cuFlushGPUDirectRDMAWrites"):
            rx.register(fab.cuda.alloc(0, 4096))
