"""What the verbs backend asks of the CUDA driver, and the lifetimes of what it gets back.

Four questions, one driver object answering them (`CudaDriver`, libcuda
through ctypes, loaded only when a CUDA region appears; the software fabric
has a double with the same methods, `sim/gpu.py`, over host memory that it
remaps the way an allocator reuses addresses):

* **Which allocation holds a region** (`locate`): `cuMemGetAddressRange`
  gives its base and size, `CU_POINTER_ATTRIBUTE_BUFFER_ID` its identity —
  unique for the life of the process, so an allocation freed and another
  made at the same address are told apart — and `..._DEVICE_ORDINAL` its GPU.
* **Its dma-buf** (`export`, via `cuMemGetHandleForAddressRange`). A dma-buf
  fd stands for the allocation's *pages*, not its addresses: reused for a
  new allocation at the same address it would register the old pages. So
  `DmaBufs` keys exports by (identity, base, size), shares one between the
  regions over one allocation (and every per-link MR of them: one BAR1
  mapping), and closes it when the last region using it is deregistered
  (`Export.close`, a child of each region). Nothing outlives `deregister`.
* **Where the GPU sits** (`bus_id`, for `topology`).
* **Whether NIC writes need a flush before a consumer may read them**
  (`flush_needed`, `flush`). `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`
  >= OWNER means writes through GPUDirect RDMA are seen in order by the
  owning GPU without a flush (Hopper and later, as NCCL's `ncclTopoNeedFlush`
  also concludes from the compute capability); below that,
  `cuFlushGPUDirectRDMAWrites(CURRENT_CTX, TO_OWNER)` — if
  `..._FLUSH_WRITES_OPTIONS` has the HOST bit — blocks until they are
  visible. A GPU that offers neither is refused at registration
  (`CapabilityError`): a notify could run before its bytes are readable.
  `Flushes` holds, per engine, the GPUs with registered memory that need it;
  the progress thread flushes them before it delivers notifies.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..errors import CapabilityError

CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_FLUSH_WRITES_OPTIONS = 117  # ..._GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
CU_DEVICE_ATTRIBUTE_WRITES_ORDERING = 118  # ..._GPU_DIRECT_RDMA_WRITES_ORDERING
FLUSH_OPTION_HOST = 1  # CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
ORDERING_OWNER = 100  # CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER
FLUSH_TARGET_CURRENT_CTX = 0
FLUSH_TO_OWNER = 100


@dataclass(frozen=True)
class Allocation:
    """The CUDA allocation a region lies in."""

    gpu: int  # CUDA device ordinal
    base: int
    size: int
    ident: int  # CU_POINTER_ATTRIBUTE_BUFFER_ID: never reused within a process


class CudaDriver:
    """The driver calls the backend makes, through libcuda (loaded on first use)."""

    def __init__(self) -> None:
        self._cu: Any = None
        self._lock = threading.Lock()
        self._contexts: dict[int, tuple] = {}  # gpu -> (retained primary context, CUdevice)

    def _lib(self) -> Any:
        if self._cu is None:
            try:
                cu = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CapabilityError(f"libcuda.so.1 not loadable: {exc}") from exc
            _check(cu.cuInit(0), "cuInit")
            self._cu = cu
        return self._cu

    def locate(self, region: Any) -> Allocation | None:
        """The allocation holding a CUDA region; None for host memory."""
        if region.device != "cuda":
            return None
        cu = self._lib()
        ptr = ctypes.c_uint64(region.start)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
               f"cuMemGetAddressRange({region.start:#x})")
        ident, ordinal = ctypes.c_ulonglong(), ctypes.c_int()
        _check(cu.cuPointerGetAttribute(ctypes.byref(ident), CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr),
               "cuPointerGetAttribute(BUFFER_ID)")
        _check(cu.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
               "cuPointerGetAttribute(DEVICE_ORDINAL)")
        return Allocation(ordinal.value, base.value, size.value, ident.value)

    def export(self, alloc: Allocation) -> int:
        """A new dma-buf fd over the whole allocation (the caller closes it)."""
        fd = ctypes.c_int(-1)
        _check(self._lib().cuMemGetHandleForAddressRange(
            ctypes.byref(fd), ctypes.c_uint64(alloc.base), ctypes.c_size_t(alloc.size),
            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0)), "cuMemGetHandleForAddressRange")
        return fd.value

    def bus_id(self, gpu: int) -> str:
        """The GPU's PCI bus id, e.g. "0000:18:00.0"."""
        buf = ctypes.create_string_buffer(32)
        _check(self._lib().cuDeviceGetPCIBusId(buf, 32, self._device(gpu)), "cuDeviceGetPCIBusId")
        return buf.value.decode().lower()

    def _device(self, gpu: int) -> ctypes.c_int:
        cu, dev = self._lib(), ctypes.c_int()
        _check(cu.cuDeviceGet(ctypes.byref(dev), gpu), f"cuDeviceGet({gpu})")
        return dev

    def _attribute(self, gpu: int, attr: int) -> int:
        value = ctypes.c_int()
        _check(self._lib().cuDeviceGetAttribute(ctypes.byref(value), attr, self._device(gpu)),
               f"cuDeviceGetAttribute({attr})")
        return value.value

    def flush_needed(self, gpu: int) -> bool:
        """Whether NIC writes to `gpu` need a flush; `CapabilityError` if they would and cannot get one."""
        if not flush_policy(gpu, self._attribute(gpu, CU_DEVICE_ATTRIBUTE_WRITES_ORDERING),
                            self._attribute(gpu, CU_DEVICE_ATTRIBUTE_FLUSH_WRITES_OPTIONS)):
            return False
        with self._lock:
            if gpu not in self._contexts:  # the flush targets the current context: torch's, the primary
                dev, ctx = self._device(gpu), ctypes.c_void_p()
                _check(self._lib().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                       "cuDevicePrimaryCtxRetain")
                self._contexts[gpu] = (ctx, dev)
        return True

    def flush(self, gpu: int) -> None:
        """Block until every GPUDirect RDMA write to `gpu` so far is visible to it."""
        cu = self._lib()
        _check(cu.cuCtxSetCurrent(self._contexts[gpu][0]), "cuCtxSetCurrent")
        _check(cu.cuFlushGPUDirectRDMAWrites(FLUSH_TARGET_CURRENT_CTX, FLUSH_TO_OWNER),
               "cuFlushGPUDirectRDMAWrites")

    def close(self) -> None:
        """Release the primary contexts retained for flushing."""
        with self._lock:
            held, self._contexts = list(self._contexts.values()), {}
        for _, dev in held:
            self._cu.cuDevicePrimaryCtxRelease_v2(dev)


def flush_policy(gpu: int, ordering: int, options: int) -> bool:
    """Whether NIC writes to a GPU with these attributes need a flush (`CapabilityError`: impossible)."""
    if ordering >= ORDERING_OWNER:
        return False
    if not options & FLUSH_OPTION_HOST:
        raise CapabilityError(
            f"GPU {gpu} neither orders GPUDirect RDMA writes (WRITES_ORDERING={ordering}) nor offers "
            f"cuFlushGPUDirectRDMAWrites (FLUSH_WRITES_OPTIONS={options}): a notify could run before "
            "the bytes are visible; update the GPU driver (CUDA >= 11.3)")
    return True


def _check(rc: int, what: str) -> None:
    if rc:
        raise CapabilityError(f"{what} failed: CUresult {rc}")


class Export:
    """One region's hold on its allocation's dma-buf (the region's child "dmabuf")."""

    def __init__(self, table: DmaBufs, key: tuple, fd: int, alloc: Allocation) -> None:
        self._table, self._key = table, key
        self.fd, self.alloc = fd, alloc
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._table.release(self._key)


class DmaBufs:
    """An engine's dma-buf exports, one per live allocation, closed with the last region using it."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._held: dict[tuple, list[int]] = {}  # key -> [fd, holders]

    def acquire(self, alloc: Allocation) -> Export:
        """This allocation's export (made on first use), held until the returned `Export` closes."""
        key = (alloc.ident, alloc.base, alloc.size)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held[1] += 1
                return Export(self, key, held[0], alloc)
        fd = self._driver.export(alloc)  # outside the lock: a driver call
        with self._lock:
            held = self._held.get(key)
            if held is not None:  # another region of the allocation exported meanwhile
                held[1] += 1
                spare, fd = fd, held[0]
            else:
                self._held[key] = [fd, 1]
                spare = None
        if spare is not None:
            os.close(spare)
        return Export(self, key, fd, alloc)

    def release(self, key: tuple) -> None:
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1]:
                return
            del self._held[key]
        os.close(held[0])

    def __len__(self) -> int:
        """Exports open now (tests)."""
        return len(self._held)


class Flushes:
    """The GPUs whose registered memory needs a flush before a notify, counted by region."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._gpus: Counter = Counter()
        self.done = 0  # flush calls made (tests, benches)

    def hold(self, gpu: int) -> FlushHold:
        """Flush `gpu` before notifies while the returned hold (a region's child) is open."""
        with self._lock:
            self._gpus[gpu] += 1
        return FlushHold(self, gpu)

    def drop(self, gpu: int) -> None:
        with self._lock:
            self._gpus[gpu] -= 1
            if self._gpus[gpu] <= 0:
                del self._gpus[gpu]

    def flush(self) -> None:
        """Make every NIC write so far visible on each GPU that needs it (progress thread)."""
        with self._lock:
            gpus = list(self._gpus)
        for gpu in gpus:
            self._driver.flush(gpu)
        self.done += len(gpus)

    def __bool__(self) -> bool:
        return bool(self._gpus)


class FlushHold:
    """A region's reason to flush its GPU (its child "flush")."""

    def __init__(self, flushes: Flushes, gpu: int) -> None:
        self._flushes, self._gpu, self._closed = flushes, gpu, False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._flushes.drop(self._gpu)
