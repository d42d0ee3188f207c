"""Backends by name, imported lazily.

The one place that knows which backends exist. A backend whose import fails
(NIXL not installed, no pyverbs) is simply absent from `available()`; asking
for it by name raises `CapabilityError` carrying the import failure and the
install hint, instead of an `ImportError` from somewhere inside.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .base import Capabilities, TransportEngine
from .errors import CapabilityError

# name -> (module, class, how to get it). Adding a backend is one line here.
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "loopback": (".loopback", "LoopbackEngine", "built in"),
    "tcp": (".tcp", "TcpEngine", "built in"),
    "nixl": (".nixl", "NixlEngine", "pip install nixl-cu12 (bundles UCX)"),
    "nixl-all": (".nixl", "NixlFullEngine", "pip install nixl-cu12 (bundles UCX)"),
    "verbs": (".verbs_hw", "VerbsEngine", "python3-pyverbs and an ACTIVE RDMA port"),
    "verbs-sim": (".verbs", "SoftVerbsEngine", "built in: the software verbs fabric"),
}


def _load(name: str) -> type[TransportEngine]:
    if name not in _BACKENDS:
        raise CapabilityError(
            f"unknown transport {name!r}; known: {', '.join(sorted(_BACKENDS))}"
        )
    module, cls, hint = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module, __package__), cls)
    except ImportError as exc:
        raise CapabilityError(f"transport {name!r} is not installed ({hint}): {exc}") from exc


# Configured variants of a backend (name -> the backend it configures): made
# by name like any backend, but not in `available()`, so suites that run over
# every backend (the engine's) do not run each twice. The transport
# conformance suite and `pdxfer bench transport` add them (`variants()`).
_VARIANTS = {"nixl-all": "nixl"}  # UCX's full transport list: cannot fence


def available() -> list[str]:
    """Names of the backends that import on this machine (variants excluded: see `variants`)."""
    return [name for name in _BACKENDS if name not in _VARIANTS and _importable(name)]


def variants() -> list[str]:
    """Names of the configured variants whose backend imports here (e.g. `nixl-all`)."""
    return [name for name in _VARIANTS if name in _BACKENDS and _importable(name)]


def _importable(name: str) -> bool:
    try:
        _load(name)
    except CapabilityError:
        return False
    return True


def capabilities(name: str) -> Capabilities:
    """What backend `name` can do in its default configuration, without creating an engine.

    The class's flags: one place answers "may its peers live in another
    process?" for launchers, benches and tests alike. An instance may differ
    where an option changes the answer (nixl's `tls`: `fence`, `cuda_memory`);
    ask `engine.capabilities` for those. `CapabilityError` if it is absent.
    """
    return _load(name).capabilities


def options(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """`(used, ignored)`: the keyword options backend `name` acts on, and those it only accepts.

    Read from the constructor's signature, so it cannot drift from what
    `create` takes; `ignored` is the backend's `IGNORED_OPTIONS` — the common
    options (host, port, streams) it accepts so callers can pass one set to any
    backend, but has no use for. `CapabilityError` if the backend is absent.
    """
    cls = _load(name)
    params = inspect.signature(cls.__init__).parameters
    names = frozenset(p for p in params if p != "self"
                      and params[p].kind in (params[p].POSITIONAL_OR_KEYWORD, params[p].KEYWORD_ONLY))
    ignored = frozenset(getattr(cls, "IGNORED_OPTIONS", ()))
    return names - ignored, ignored & names


def create(name: str, **options: Any) -> TransportEngine:
    """A new engine of backend `name`, configured by keyword options."""
    return _load(name)(**options)
