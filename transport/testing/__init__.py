"""The transport conformance kit: every case of the contract, as a function of a backend factory.

Any backend — ours or a third party's — is held to the same contract by
running the kit over it. In a pytest module:

    from pdxfer.transport.testing import Backend, conformance
    from mypkg import MyEngine

    globals().update(conformance([Backend("mine", lambda **opts: MyEngine(**opts))]))

`Backend(label, create, spawn=None, declared=None)`: `create(**options)`
makes a new engine (the kit passes options such as `connect_timeout`,
`max_pending`, `host` to the cases that need them, and expects an option the
backend does not take to raise `CapabilityError`); `spawn = (name, options)`
lets the cases that need a peer in another process start one through
`transport.create(name, **options)` (without it they skip, saying so);
`declared` is the capabilities the backend promises without building an
engine (checked against one). Cases skip only on a declared capability
(`capabilities.fence`, `cross_process`, `listens`, `cuda_memory`), and
each skip names the flag.

The project runs it over every configuration the registry names
(`registry_backends()`: each backend, each variant, and the option sets in
`transport.registry`'s configurations table) in
tests/transport/test_kit_conformance.py. The cases live in `cases_*.py`, one
topic each; `rig.py` has the pair of engines and the gates; `tables.py` the
random tables and canary checks; `peer.py` the peer process, which `forked.py`
starts by forking a server that imported torch once (seconds less per peer).
"""

from .rig import Backend, Gate, Rig, StepGate, need, until
from .suite import cases, conformance, registry_backends
from .tables import CANARY, assert_landed, random_table

__all__ = [
    "CANARY",
    "Backend",
    "Gate",
    "Rig",
    "StepGate",
    "assert_landed",
    "cases",
    "conformance",
    "need",
    "random_table",
    "registry_backends",
    "until",
]
