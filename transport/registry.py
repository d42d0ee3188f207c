"""Backends by name, imported lazily; their named variants; the configurations the kit covers.

The one place that knows which backends exist. A backend whose import fails
(NIXL not installed, no pyverbs) is simply absent from `available()`; asking
for it by name raises `CapabilityError` carrying the import failure and the
install hint, instead of an `ImportError` from somewhere inside.

Three tables:

* `_BACKENDS`: name -> the engine class (module, class, how to get it).
* `_VARIANTS`: a named configuration of a backend — `nixl-all` is `nixl`
  with `tls="all"`. Made by name like a backend (`create("nixl-all")`), not
  in `available()` (suites over every backend, the PD engine's, do not run
  it twice), listed by `variants()`. Its capabilities come from the same
  `capabilities_for(options)` the engine's constructor calls, so the name
  and an engine made by it cannot disagree (#25 item 7).
* `_CONFIGURATIONS`: option sets the conformance kit (`transport.testing`)
  runs beside each name's defaults — configurations that change what the
  backend promises (the fence). `configurations()` is the full list: every
  available backend and variant, then these.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from .base import Capabilities, TransportEngine
from .errors import CapabilityError

# name -> (module, class, how to get it). Adding a backend is one line here.
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "loopback": (".loopback", "LoopbackEngine", "built in"),
    "tcp": (".tcp", "TcpEngine", "built in"),
    "nixl": (".nixl", "NixlEngine", "pip install nixl-cu12 (bundles UCX)"),
    "verbs": (".verbs.hw", "VerbsEngine", "python3-pyverbs and an ACTIVE RDMA port"),
    "verbs-sim": (".verbs.sim", "SoftVerbsEngine", "built in: the software verbs fabric"),
    "ucx": (".ucx", "UcxEngine", "pip install 'pdxfer[ucx]' (ucxx-cu12, bundles UCX)"),
}

# Named variants: name -> (backend, the options it pins).
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl-all": ("nixl", {"tls": "all"}),  # UCX's full transport list: VRAM, one-sided, no fence
    "ucx-all": ("ucx", {"tls": "all"}),  # UCXX over UCX's full list: VRAM, no fence
}

# Configurations the conformance kit runs beside each name's defaults: (name, options).
_CONFIGURATIONS: list[tuple[str, dict[str, Any]]] = [
    ("tcp", {"fence": False}),  # the engine's no-fence (quarantine) path on a fenceable backend
    ("verbs-sim", {"fence": "qp"}),  # one shared MR per region: no fence
]


@dataclass(frozen=True)
class Configuration:
    """One configuration of one backend: `create(name, **options)`, called `label` in test ids."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def create(self, **extra: Any) -> TransportEngine:
        """A new engine of this configuration (`extra` options added)."""
        return create(self.name, **self.options, **extra)

    def capabilities(self) -> Capabilities:
        """Its capabilities, from the backend's `capabilities_for` (no engine built)."""
        backend, pinned = _resolve(self.name)
        return _load(backend).capabilities_for({**pinned, **self.options})


def _resolve(name: str) -> tuple[str, dict[str, Any]]:
    """`(backend, pinned options)` of a backend or variant name."""
    if name in _VARIANTS:
        return _VARIANTS[name]
    return name, {}


def _load(name: str) -> Any:
    if name not in _BACKENDS:
        raise CapabilityError(
            f"unknown transport {name!r}; known: {', '.join(sorted([*_BACKENDS, *_VARIANTS]))}"
        )
    module, cls, hint = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module, __package__), cls)
    except ImportError as exc:
        raise CapabilityError(f"transport {name!r} is not installed ({hint}): {exc}") from exc


def available() -> list[str]:
    """Names of the backends that import on this machine (variants excluded: see `variants`)."""
    return [name for name in _BACKENDS if _importable(name)]


def known() -> list[str]:
    """Every backend and variant name this kit knows, installed here or not."""
    return [*_BACKENDS, *_VARIANTS]


def why_unavailable(name: str) -> str | None:
    """Why backend or variant `name` cannot be made here (the import failure and install hint), or None.

    The same rule `available()` applies, worded: `pdxfer doctor` prints it.
    """
    if name not in _BACKENDS and name not in _VARIANTS:
        raise CapabilityError(f"unknown transport {name!r}; known: {', '.join(sorted(known()))}")
    try:
        _load(_resolve(name)[0])
    except CapabilityError as exc:
        return str(exc)
    return None


def variants() -> list[str]:
    """Names of the configured variants whose backend imports here (e.g. `nixl-all`)."""
    return [name for name, (backend, _) in _VARIANTS.items() if _importable(backend)]


def configurations() -> list[Configuration]:
    """Every configuration the conformance kit covers here: each backend and variant, then `_CONFIGURATIONS`."""
    out = [Configuration(name, name) for name in available() + variants()]
    for name, options in _CONFIGURATIONS:
        if _importable(_resolve(name)[0]):
            shown = ",".join(f"{k}={v!r}" for k, v in options.items())
            out.append(Configuration(f"{name}[{shown}]", name, dict(options)))
    return out


def _importable(name: str) -> bool:
    try:
        _load(name)
    except CapabilityError:
        return False
    return True


def capabilities(name: str) -> Capabilities:
    """What backend or variant `name` can do in its default configuration, without creating an engine.

    The backend's `capabilities_for` with the variant's pinned options: the
    same computation its engines make. An instance whose own options change
    an answer (nixl's `tls`, `fence=False`) says so in `engine.capabilities`.
    `CapabilityError` if it is absent.
    """
    backend, pinned = _resolve(name)
    return _load(backend).capabilities_for(pinned)


def _params(cls: type) -> frozenset[str]:
    params = inspect.signature(cls.__init__).parameters
    return frozenset(p for p in params if p != "self"
                     and params[p].kind in (params[p].POSITIONAL_OR_KEYWORD, params[p].KEYWORD_ONLY))


def options(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """`(used, ignored)`: the keyword options backend `name` acts on, and those it only accepts.

    Read from the constructor's signature, so it cannot drift from what
    `create` takes; `ignored` is the backend's `UNUSED_OPTIONS` — the common
    options (`host`, `connect_timeout`) every backend accepts because a
    deployment passes them to whichever backend it names, for a backend with
    no use for them. A variant's pinned options are not offered. Anything
    else is refused by `create`. `CapabilityError` if the backend is absent.
    """
    backend, pinned = _resolve(name)
    cls = _load(backend)
    names = _params(cls) - set(pinned)
    ignored = frozenset(getattr(cls, "UNUSED_OPTIONS", ())) & names
    return names - ignored, ignored


def create(name: str, **options: Any) -> TransportEngine:
    """A new engine of backend or variant `name`, configured by keyword options.

    An option the backend does not take is refused (`CapabilityError` naming
    it and the valid ones), as is one a variant pins.
    """
    from .engine import check_options

    backend, pinned = _resolve(name)
    cls = _load(backend)
    clash = sorted(set(pinned) & set(options))
    if clash:
        raise CapabilityError(
            f"transport {name!r} pins {clash[0]}={pinned[clash[0]]!r}; create {backend!r} "
            f"with {clash[0]}=... instead")
    check_options(cls, _params(cls), options)
    return cls(**pinned, **options)
