"""Registering a region's memory with a verbs PD: host by address, CUDA by dma-buf or peermem.

Host memory is registered where it already lives — `MR(pd, length, access,
address=tensor.data_ptr())`: pyverbs then deregisters on close and never
allocates or frees (an address of 0 would make pyverbs allocate its own
buffer, which is why a region's address is asserted non-zero). The region
keeps the tensor referenced, so the pinned pages cannot be freed under it.

CUDA memory: first a dma-buf MR over the whole allocation
(`cuMemGetHandleForAddressRange`, exported once per allocation and kept
open), whose iova under pyverbs 44 is the dma-buf *offset* — so addresses
for SGEs and remote writes are `base + offset` with `base` the offset of the
region inside its allocation. Without dma-buf support, `MR(address=ptr)`
works only when the nvidia-peermem module is loaded. Otherwise a
`CapabilityError` names both ways. Not run here (no GPU, no NIC): written
from the CUDA driver API and pyverbs' DmaBufMR, to be proven by the
hardware suite (tests/hardware).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from ..errors import CapabilityError, RegistrationError
from ..regions import Region

_CU_DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
_PEERMEM = "/sys/module/nvidia_peermem"


def access_flags(api: Any, remote_write: bool) -> int:
    """LOCAL_WRITE always (receive buffers, and required with REMOTE_WRITE); REMOTE_WRITE on request."""
    A = api.E.ibv_access_flags
    return int(A.IBV_ACCESS_LOCAL_WRITE | (A.IBV_ACCESS_REMOTE_WRITE if remote_write else 0))


def register_mr(api: Any, pd: Any, region: Region, access: int, dmabufs: dict) -> tuple[Any, int]:
    """`(mr, base)`: an MR over `region` and the address of its first byte in that MR's space."""
    if region.device == "cpu":
        if not region.start:
            raise RegistrationError("a host region at address 0 cannot be registered by address")
        try:
            return api.MR(pd, region.length, access, address=region.start), region.start
        except api.PyverbsError as exc:
            raise RegistrationError(
                f"ibv_reg_mr of {region.length} B at {region.start:#x} failed: {exc}; "
                "raise the memlock limit (ulimit -l) or register less memory"
            ) from exc
    return _register_cuda(api, pd, region, access, dmabufs)


def _register_cuda(api: Any, pd: Any, region: Region, access: int, dmabufs: dict) -> tuple[Any, int]:
    dmabuf_error = "no dma-buf export"
    try:
        fd, alloc_base = _dmabuf(region.start, dmabufs)
        offset = region.start - alloc_base
        return api.DmaBufMR(pd, region.length, access, dmabuf=fd, offset=offset), offset
    except (OSError, api.PyverbsError, CapabilityError) as exc:
        dmabuf_error = str(exc)
    if os.path.isdir(_PEERMEM):
        try:
            return api.MR(pd, region.length, access, address=region.start), region.start
        except api.PyverbsError as exc:
            raise RegistrationError(f"peermem registration of CUDA memory failed: {exc}") from exc
    raise CapabilityError(
        f"cannot register CUDA memory with the NIC: dma-buf MR failed ({dmabuf_error}) and the "
        "nvidia-peermem module is not loaded; use the open GPU kernel modules with a dma-buf "
        "capable kernel, or `modprobe nvidia-peermem`"
    )


def _dmabuf(ptr: int, cache: dict) -> tuple[int, int]:
    """`(fd, allocation base)` of the CUDA allocation holding `ptr`, exported once per allocation."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CapabilityError(f"libcuda.so.1 not loadable: {exc}") from exc
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)):
        raise CapabilityError(f"cuMemGetAddressRange failed for {ptr:#x}")
    if base.value in cache:
        return cache[base.value], base.value
    fd = ctypes.c_int(-1)
    rc = cu.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(base.value), size,
                                          _CU_DMA_BUF_FD, ctypes.c_ulonglong(0))
    if rc:
        raise CapabilityError(f"cuMemGetHandleForAddressRange returned CUresult {rc}")
    cache[base.value] = fd.value
    return fd.value, base.value


def close_dmabufs(cache: dict) -> None:
    """Close the exported dma-buf fds (after every MR over them is closed)."""
    for fd in cache.values():
        try:
            os.close(fd)
        except OSError:
            pass
    cache.clear()
