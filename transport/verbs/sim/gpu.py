"""A CUDA driver double for the software fabric: "GPU memory" that behaves as the verbs path relies on.

There is no GPU here, yet the verbs backend's GPU paths — which NIC a GPU's
pool takes, dma-buf exports and their lifetime, the flush before a notify —
must run in every `make test`. So this double answers the same calls as
`cuda.CudaDriver` (`locate`, `export`, `bus_id`, `flush_needed`, `flush`)
about memory it hands out itself (`alloc`, `free`), and keeps the two
properties of device memory those paths exist for:

* **Addresses are reused, pages are not.** Each allocation is its own
  memfd mapped (`MAP_FIXED`) into a per-GPU address window; `free` puts
  fresh anonymous pages there, and the next `alloc(at=...)` maps a new memfd
  at the same address. A dma-buf export is a dup of the allocation's memfd:
  like a real dma-buf it stands for the *pages*, so a stale export reused
  for a new allocation at the same address registers the old pages, and
  bytes written through it never appear in the new tensor.
* **NIC writes need a flush on GPUs that do not order them.** The fabric
  counts packets it places into a dma-buf MR of a GPU whose
  `writes_ordering` is below OWNER (`placed`); `flush` (what
  `cuFlushGPUDirectRDMAWrites` stands for) clears the count. A test's
  notify handler asks `unflushed(gpu)`: non-zero means the notify ran before
  the bytes were made visible.

Tensors are CPU tensors over the mapped window (the transport's regions see
`device == "cpu"`); the double, not the tensor, says which GPU they are on.
Linux only (memfd, mmap with MAP_FIXED).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CapabilityError
from ..cuda import ORDERING_OWNER, Allocation, flush_policy
from .net import SimGpu

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FIXED, MAP_NORESERVE, PROT_NONE = 0x10, 0x4000, 0  # Linux values (the mmap module lacks them)
RW = mmap.PROT_READ | mmap.PROT_WRITE
WINDOW = 1 << 32  # address space reserved per GPU (virtual only)
_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, length: int, at: int | None = None) -> int:
    """mmap `length` bytes of `fd` shared (at `at`, replacing what is there); the address."""
    flags = mmap.MAP_SHARED | (MAP_FIXED if at else 0)
    got = _libc.mmap(at, length, RW, flags, fd, 0)
    if got in (None, _FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of fd {fd} failed")
    return got


def map_anonymous(length: int, at: int | None = None, prot: int = RW) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if at else 0)
    got = _libc.mmap(at, length, prot, flags, -1, 0)
    if got in (None, _FAILED):
        raise OSError(ctypes.get_errno(), "anonymous mmap failed")
    return got


def unmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


@dataclass
class _Alloc:
    gpu: int
    va: int
    size: int
    ident: int
    memfd: int
    live: bool = True


class CudaDouble:
    """Allocations on fake GPUs, and the driver calls the verbs backend makes about them."""

    def __init__(self, gpus: tuple[SimGpu, ...]) -> None:
        self.gpus = gpus
        self._lock = threading.Lock()
        self._windows: dict[int, list[int]] = {}  # gpu -> [base, next free offset]
        self._allocs: dict[int, _Alloc] = {}  # va -> allocation (live or freed, last at that va)
        self._idents = itertools.count(1)
        self._exports: dict[int, int] = {}  # inode of an exported memfd -> gpu
        self._unflushed: collections.Counter = collections.Counter()
        self.flushes: collections.Counter = collections.Counter()  # gpu -> flush calls
        self.exported = 0  # exports made (tests)

    # -- the allocator ----------------------------------------------------------------
    def alloc(self, gpu: int, nbytes: int, *, at: int | None = None) -> torch.Tensor:
        """`nbytes` of "device memory" on `gpu` (at address `at`, a freed allocation's, if given)."""
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            window = self._windows.get(gpu)
            if window is None:
                window = self._windows[gpu] = [map_anonymous(WINDOW, prot=PROT_NONE), 0]
            if at is None:
                at, window[1] = window[0] + window[1], window[1] + size + mmap.PAGESIZE
            old = self._allocs.get(at)
            if old is not None and (old.live or old.size < size):
                raise ValueError(f"soft GPU {gpu}: {at:#x} is in use or too small for {nbytes} B")
            fd = os.memfd_create(f"soft-gpu{gpu}")
            os.ftruncate(fd, size)
            map_fd(fd, size, at)
            self._allocs[at] = _Alloc(gpu, at, size, next(self._idents), fd)
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(at), dtype=torch.uint8)

    def free(self, tensor: torch.Tensor) -> int:
        """Free the allocation `tensor` starts at (its address is reused by `alloc(at=)`); the address."""
        va = tensor.data_ptr()
        with self._lock:
            a = self._allocs.get(va)
            if a is None or not a.live:
                raise ValueError(f"{va:#x} is not a live soft GPU allocation")
            a.live = False
            map_anonymous(a.size, a.va)  # the tensor now reads fresh zero pages, never the old ones
            os.close(a.memfd)  # an export (a dup) keeps the pages, as a dma-buf keeps its buffer
        return va

    def release_all(self) -> None:
        """Unmap every allocation and window (the fabric's close)."""
        with self._lock:
            for a in self._allocs.values():
                if a.live:
                    os.close(a.memfd)
            self._allocs.clear()
            for base, _ in self._windows.values():
                unmap(base, WINDOW)
            self._windows.clear()

    # -- the driver calls (as cuda.CudaDriver) ------------------------------------------------
    def locate(self, region: Any) -> Allocation | None:
        with self._lock:
            for a in self._allocs.values():
                if a.live and a.va <= region.start < a.va + a.size:
                    return Allocation(a.gpu, a.va, a.size, a.ident)
        return None

    def export(self, alloc: Allocation) -> int:
        if not self.gpus[alloc.gpu].dmabuf:
            raise CapabilityError("cuMemGetHandleForAddressRange failed: CUresult 801 (not supported)")
        with self._lock:
            a = self._allocs.get(alloc.base)
            if a is None or not a.live or a.ident != alloc.ident:
                raise CapabilityError(f"cuMemGetHandleForAddressRange failed: CUresult 1 ({alloc.base:#x})")
            fd = os.dup(a.memfd)
            self._exports[os.fstat(fd).st_ino] = alloc.gpu
            self.exported += 1
        return fd

    def bus_id(self, gpu: int) -> str:
        return self.gpus[gpu].pci[-1]

    def flush_needed(self, gpu: int) -> bool:
        spec = self.gpus[gpu]
        return flush_policy(gpu, spec.writes_ordering, spec.flush_options)

    def flush(self, gpu: int) -> None:
        with self._lock:
            self._unflushed[gpu] = 0
            self.flushes[gpu] += 1

    def close(self) -> None:
        """An engine is done with the driver: the double outlives engines (it is the fabric's)."""

    # -- what the fabric asks ---------------------------------------------------------------
    def gpu_of(self, fd: int) -> int | None:
        """The GPU whose exported pages `fd` is (None: not an export of ours)."""
        with self._lock:
            return self._exports.get(os.fstat(fd).st_ino)

    def staged(self, gpu: int | None) -> bool:
        """Whether NIC writes into `gpu`'s memory wait for a flush to be visible."""
        return gpu is not None and self.gpus[gpu].writes_ordering < ORDERING_OWNER

    def placed(self, gpu: int) -> None:
        """The NIC placed a packet in `gpu`'s memory (not visible until the next flush)."""
        with self._lock:
            self._unflushed[gpu] += 1

    def unflushed(self, gpu: int) -> int:
        """Packets placed in `gpu`'s memory since its last flush."""
        with self._lock:
            return self._unflushed[gpu]
