"""The verbs backend on a software RC fabric: one process, no NIC needed ("verbs-sim").

`verbs.py` mirrors the part of pyverbs' surface the backend uses, `nic.py`
is the NIC thread that executes work requests as an RC HCA would (ordering,
the revoke contract, limits, completion errors, fault injection).
`SoftVerbsEngine` is the unchanged backend (`verbs.engine.VerbsEngine`)
with `namespace()` as its verbs: every `make test` runs the verbs code.
"""

from __future__ import annotations

import types
from typing import Any

import pdxfer.transport.verbs.sim.verbs as soft  # absolute: no import back to this package

from ...base import Capabilities
from ..api import NAMES
from ..engine import VerbsEngine

__all__ = ["SoftVerbsEngine", "fabric", "namespace"]


def namespace() -> types.SimpleNamespace:
    """The software fabric under the same names as `api.load()` gives real pyverbs."""
    ns = types.SimpleNamespace(E=soft.E)
    for names in NAMES.values():
        for name in names:
            setattr(ns, name, getattr(soft, name))
    return ns


def fabric() -> Any:
    """The fabric the soft devices of this process sit on (for fault injection in tests)."""
    return soft.fabric()


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
