"""Which software fabric soft devices are made on: the process's own, or one a test installed.

A fabric stands for the NICs of one host, so soft devices — and through them
verbs-sim engines — are made on one current fabric: the process's default
(one NIC, `soft0`, made on first use and kept, as a NIC outlives its users),
or, inside `use(fabric)`, a fabric a test built for another host (several
NICs and GPUs, subnets and routers: `net.Topology`). Leaving the block
closes that fabric (its NIC thread, fake sysfs tree and GPU memory).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .nic import Fabric

_default: Fabric | None = None
_current: list[Fabric] = []  # fabrics a test installed (`use`), innermost last
_default_lock = threading.Lock()


def default_fabric() -> Fabric:
    """The fabric soft devices are made on now: the one a test installed, else the process's own."""
    global _default
    with _default_lock:
        if _current:
            return _current[-1]
        if _default is None:
            _default = Fabric()
        return _default


@contextlib.contextmanager
def use(fabric: Fabric) -> Iterator[Fabric]:
    """Make soft devices (and so verbs-sim engines) on `fabric` inside the block; close it after."""
    with _default_lock:
        _current.append(fabric)
    try:
        yield fabric
    finally:
        with _default_lock:
            _current.remove(fabric)
        fabric.close()
