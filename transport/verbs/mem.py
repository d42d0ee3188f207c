"""Registering a region's memory with a verbs PD: host by address, CUDA by dma-buf or peermem.

Host memory is registered where it already lives — `MR(pd, length, access,
address=tensor.data_ptr())`: pyverbs then deregisters on close and never
allocates or frees (an address of 0 would make pyverbs allocate its own
buffer, which is why a region's address is asserted non-zero). The region
keeps the tensor referenced, so the pinned pages cannot be freed under it.

CUDA memory is decided once per region, at `register()` (`prepare`), before
any MR exists: the allocation holding it (`cuda.CudaDriver.locate`), whether
its GPU needs a flush before notifies (a `cuda.FlushHold`), and its dma-buf
export (`cuda.DmaBufs`, shared by the regions of one allocation). All of it
is the region's child "cuda", so `deregister` releases it after the MRs over
it. Every MR over the region then follows that choice (`register_mr`): a
`DmaBufMR` whose iova under pyverbs 44 is the dma-buf *offset* — so SGE and
remote addresses are `base + offset` with `base` the region's offset inside
its allocation — or, where dma-buf registration fails and the nvidia-peermem
module is loaded, `MR(address=ptr)`. Otherwise a `CapabilityError` names
both ways. On the software fabric the same code runs against its CUDA
double (`sim/gpu.py`); on a GPU it is proven by the hardware suite
(tests/hardware) only.
"""

from __future__ import annotations

import os
from typing import Any

from .. import gpudirect
from ..errors import CapabilityError, RegistrationError
from ..regions import Region
from .cuda import Allocation, DmaBufs, Export, Flushes, FlushHold

PEERMEM = "/sys/module/nvidia_peermem"


def access_flags(api: Any, remote_write: bool) -> int:
    """LOCAL_WRITE always (receive buffers, and required with REMOTE_WRITE); REMOTE_WRITE on request."""
    A = api.E.ibv_access_flags
    return int(A.IBV_ACCESS_LOCAL_WRITE | (A.IBV_ACCESS_REMOTE_WRITE if remote_write else 0))


class CudaRegion:
    """How a CUDA region is registered (its child "cuda"): its allocation, dma-buf export, flush hold."""

    def __init__(self, alloc: Allocation, export: Export | None, flush: FlushHold | None,
                 dmabuf_error: str = "") -> None:
        self.alloc, self.export, self.flush = alloc, export, flush
        self.dmabuf_error = dmabuf_error  # why dma-buf is not used (peermem then)

    def use_peermem(self, why: str) -> None:
        """dma-buf registration failed: drop the export; MRs go by address (nvidia-peermem)."""
        export, self.export, self.dmabuf_error = self.export, None, why
        if export is not None:
            export.close()

    def close(self) -> None:
        for held in (self.export, self.flush):
            if held is not None:
                held.close()


def prepare(driver: Any, dmabufs: DmaBufs, flushes: Flushes, region: Region) -> Allocation | None:
    """Decide how `region` is registered (see the module docstring); its allocation, None for host."""
    alloc = driver.locate(region)
    if alloc is None:
        return None
    flush = flushes.hold(alloc.gpu) if driver.flush_needed(alloc.gpu) else None
    try:
        export, error = dmabufs.acquire(alloc), ""
    except (CapabilityError, OSError) as exc:
        export, error = None, str(exc)
        if not os.path.isdir(PEERMEM):
            if flush is not None:
                flush.close()
            raise _neither(error, region.length) from exc
    region.adopt("cuda", CudaRegion(alloc, export, flush, error))
    return alloc


def _neither(dmabuf_error: str, nbytes: int) -> CapabilityError:
    """Neither GPU path works: a `DeviceRegistrationError` naming what this host lacks."""
    return gpudirect.registration_error(
        "the verbs NIC", nbytes, f"dma-buf MR failed ({dmabuf_error}) and the nvidia-peermem "
        "module is not loaded", dmabuf_error=dmabuf_error)


def register_mr(api: Any, pd: Any, region: Region, access: int) -> tuple[Any, int]:
    """`(mr, base)`: an MR over `region` and the address of its first byte in that MR's space."""
    cuda = region.child("cuda")
    if cuda is not None and cuda.export is not None:
        offset = region.start - cuda.alloc.base
        try:
            return api.DmaBufMR(pd, region.length, access, dmabuf=cuda.export.fd, offset=offset), offset
        except api.PyverbsError as exc:
            if not os.path.isdir(PEERMEM):
                raise _neither(str(exc), region.length) from exc
            cuda.use_peermem(str(exc))
    if not region.start:
        raise RegistrationError("a region at address 0 cannot be registered by address")
    try:
        return api.MR(pd, region.length, access, address=region.start), region.start
    except api.PyverbsError as exc:
        if cuda is not None:
            raise gpudirect.registration_error("the verbs NIC", region.length,
                                               f"peermem MR failed: {exc}",
                                               dmabuf_error=cuda.dmabuf_error) from exc
        raise RegistrationError(
            f"ibv_reg_mr of {region.length} B at {region.start:#x} failed: {exc}; "
            "raise the memlock limit (ulimit -l) or register less memory"
        ) from exc
