"""What registering GPU memory with an RDMA NIC needs from the host, asked in one place.

A NIC reaches GPU memory one of two ways: a dma-buf the GPU driver exports
(a 5.12+ kernel, and a driver that exports it: the open GPU kernel modules)
or the `nvidia_peermem` kernel module; either is enough. Pinned memory is
bounded by `RLIMIT_MEMLOCK`. When a registration of GPU memory fails, the
backend's own error says what failed ("CUresult 801", "ibv_reg_mr: Bad
address"); what the operator needs is which of those host pieces is missing.
`host()` reads them (from paths a test can hand it a fake tree of),
`missing()` words each one that is absent, and `registration_error()` builds
the `DeviceRegistrationError` every backend raises for GPU memory — so verbs,
NIXL and `pdxfer doctor` say the same thing about the same host.
"""

from __future__ import annotations

import platform
import resource
from dataclasses import dataclass
from pathlib import Path

from .errors import DeviceRegistrationError

# Where the kernel lists loaded modules; a parameter of `host()` so a test can fake one.
SYSFS_MODULES = Path("/sys/module")
DMABUF_KERNEL = (5, 12)  # ib_umem_dmabuf: RDMA MRs over a dma-buf


@dataclass(frozen=True)
class Host:
    """The host's GPU-direct pieces: `peermem` loaded, the `kernel` release, the memlock limit."""

    peermem: bool
    kernel: str
    memlock: int | None  # soft RLIMIT_MEMLOCK in bytes; None: unlimited

    @property
    def dmabuf_kernel(self) -> bool:
        """Whether the kernel can register a dma-buf with a NIC (5.12+)."""
        return kernel_version(self.kernel) >= DMABUF_KERNEL


def host(modules: Path = SYSFS_MODULES, release: str | None = None,
         memlock: int | None = -1) -> Host:
    """This host's pieces (each argument replaces what is read, for a test: -1 reads the limit)."""
    if memlock == -1:
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        memlock = None if soft == resource.RLIM_INFINITY else soft
    return Host((modules / "nvidia_peermem").is_dir(), release or platform.release(), memlock)


def kernel_version(release: str) -> tuple[int, int]:
    """`(major, minor)` of a kernel release string like `5.15.0-91-generic`; (0, 0) if unreadable."""
    parts = release.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def missing(found: Host, nbytes: int, dmabuf_error: str = "") -> list[tuple[str, str]]:
    """`(piece, sentence with the fix)` for each piece a GPU registration of `nbytes` lacks here.

    Both GPU paths are named when neither is there (either would do);
    `dmabuf_error` is the backend's reason a dma-buf export or MR failed on
    a kernel that should support it.
    """
    out = []
    if not (found.peermem or found.dmabuf_kernel and not dmabuf_error):  # neither path is there
        out.append(("nvidia_peermem", "the nvidia_peermem kernel module is not loaded "
                                      "(`modprobe nvidia-peermem`)"))
        out.append(("dma-buf", f"dma-buf export/registration failed ({dmabuf_error}): use the open "
                               "GPU kernel modules (r515+)" if found.dmabuf_kernel else
                    f"kernel {found.kernel} predates dma-buf MRs (5.12+)"))
    if found.memlock is not None and nbytes > found.memlock:
        out.append(("memlock", f"RLIMIT_MEMLOCK is {found.memlock} B, below the {nbytes} B to "
                               "pin (`ulimit -l unlimited`, LimitMEMLOCK=infinity, or docker "
                               "--ulimit memlock=-1)"))
    return out


def registration_error(what: str, nbytes: int, cause: object, *, dmabuf_error: str = "",
                       found: Host | None = None) -> DeviceRegistrationError:
    """The error for a failed registration of `nbytes` of GPU memory: the missing pieces named."""
    gaps = missing(host() if found is None else found, nbytes, dmabuf_error)
    if gaps:
        said = "; ".join(sentence for _, sentence in gaps)
        return DeviceRegistrationError(
            f"cannot register {nbytes} B of GPU memory for {what} ({cause}): missing on this "
            f"host: {said}; `pdxfer doctor` shows these, and EngineConfig(fallback='tcp') "
            "moves the bytes over tcp instead", tuple(p for p, _ in gaps))
    return DeviceRegistrationError(
        f"cannot register {nbytes} B of GPU memory for {what} ({cause}); nvidia_peermem, "
        "dma-buf and the memlock limit all look right here, so the driver or NIC refused it: "
        "check `dmesg`; EngineConfig(fallback='tcp') moves the bytes over tcp instead")
