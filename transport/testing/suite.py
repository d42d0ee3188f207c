"""Turning the kit's cases into pytest tests over a list of backends; skipping by capability.

`conformance(backends)` returns every case as a pytest test function,
parametrized over `backends` (ids: their labels): a test module puts them in
its namespace — `globals().update(conformance(backends))` — and pytest runs
them. `registry_backends()` is the list the project runs: every
configuration `transport.registry.configurations()` names.

Skips are decided only by what an engine declares: `rig.need(engine, flag)`
skips when `engine.capabilities.<flag>` is False, and the reason names the
flag — so a backend that cannot do something is never counted as passing a
test of it, and one that declares it can is held to it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# absolute imports of the case modules: `from . import x` would make this module
# depend on the package that re-exports it (an import circle by the project's count)
import pdxfer.transport.testing.cases_engine as cases_engine
import pdxfer.transport.testing.cases_faults as cases_faults
import pdxfer.transport.testing.cases_fence as cases_fence
import pdxfer.transport.testing.cases_listen as cases_listen
import pdxfer.transport.testing.cases_writes as cases_writes
import pytest

from .. import registry
from .rig import Backend, PeerPool, RigPool

CASE_MODULES = (cases_writes, cases_faults, cases_fence, cases_listen, cases_engine)


def registry_backends() -> list[Backend]:
    """Every configuration the registry names here, as kit backends (peer processes included)."""
    return [Backend(c.label, c.create, (c.name, dict(c.options)), c.capabilities())
            for c in registry.configurations()]


def cases() -> dict[str, Callable[..., Any]]:
    """Every case of the kit, by test name."""
    out: dict[str, Callable[..., Any]] = {}
    for module in CASE_MODULES:
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn):
                assert name not in out, f"case {name} defined twice"
                out[name] = fn
    return out


def _kit_rigs() -> Iterator[RigPool]:
    """The module's shared rigs (`RigPool`), closed when the module's tests are done."""
    pool = RigPool()
    try:
        yield pool
    finally:
        pool.close()


def _kit_peers() -> Iterator[PeerPool]:
    """The module's shared peer processes (`PeerPool`), killed when the module's tests are done."""
    pool = PeerPool()
    try:
        yield pool
    finally:
        pool.close()


def conformance(backends: Sequence[Backend]) -> dict[str, Callable[..., Any]]:
    """Every kit case as a pytest test parametrized over `backends` (argument `backend`).

    Also the module-scoped fixtures some cases take: `kit_rigs` (a rig per backend,
    shared by the cases that leave it as they found it) and `kit_peers` (a peer process
    per backend).
    """
    ids = [b.label for b in backends]
    out: dict[str, Callable[..., Any]] = {
        "kit_rigs": pytest.fixture(scope="module", name="kit_rigs")(_kit_rigs),
        "kit_peers": pytest.fixture(scope="module", name="kit_peers")(_kit_peers),
    }
    for name, fn in cases().items():
        # A fresh function object per call, so two modules' marks never mix.
        copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        copy.__dict__.update(fn.__dict__)
        copy.__doc__ = fn.__doc__
        copy.__module__ = fn.__module__
        out[name] = pytest.mark.parametrize("backend", list(backends), ids=ids)(copy)
    return out
