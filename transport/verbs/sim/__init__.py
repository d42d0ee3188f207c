"""The verbs backend on a software RC fabric: one process, no NIC needed ("verbs-sim").

`verbs.py` mirrors the part of pyverbs' surface the backend uses, `nic.py`
is the NIC thread that executes work requests as an RC HCA would (ordering,
the revoke contract, limits, completion errors, fault injection), `net.py`
the host and network it models (NICs, GPUs and their PCIe places, GID
tables, subnets and routers), `gpu.py` the CUDA driver double, and
`current.py` which fabric soft devices are made on.
`SoftVerbsEngine` is the unchanged backend (`verbs.engine.VerbsEngine`)
with `namespace()` as its verbs and the fabric's CUDA double and sysfs tree
as its host: every `make test` runs the verbs code. `use(Fabric(topology))`
puts the engines made inside the block on another host (tests).
"""

from __future__ import annotations

import types
from typing import Any

import pdxfer.transport.verbs.sim.current as current  # absolute: no import back to this package
import pdxfer.transport.verbs.sim.nic as nic
import pdxfer.transport.verbs.sim.verbs as soft

from ...base import Capabilities
from ..api import NAMES
from ..engine import VerbsEngine

__all__ = ["Fabric", "SoftVerbsEngine", "fabric", "namespace", "use"]


def namespace() -> types.SimpleNamespace:
    """The software fabric under the same names as `api.load()` gives real pyverbs."""
    ns = types.SimpleNamespace(E=soft.E)
    for names in NAMES.values():
        for name in names:
            setattr(ns, name, getattr(soft, name))
    return ns


def fabric() -> Any:
    """The fabric soft devices are made on now (for fault injection in tests)."""
    return soft.fabric()


Fabric = nic.Fabric
use = current.use


class SoftVerbsEngine(VerbsEngine):
    """The verbs backend on the software fabric: one process, no NIC needed."""

    name = "verbs-sim"
    capabilities = Capabilities(
        cuda_memory=False, cuda_zero_copy=False, cross_process=False,
        one_sided=True, notify=True, read=False,
    )

    @staticmethod
    def load_api() -> Any:
        return namespace()

    @staticmethod
    def load_host() -> tuple[Any, str]:
        fab = soft.fabric()
        return fab.cuda, fab.sysfs
