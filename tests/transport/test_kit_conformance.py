"""The conformance kit (`transport.testing`) over every configuration the registry names.

One parametrized test per kit case and configuration: loopback, tcp,
tcp fence=False, nixl, nixl-all, verbs-sim, verbs-sim fence='qp' (those that
import here), taken from `transport.registry.configurations()`. A backend
added to the registry inherits the whole kit; a case a configuration
cannot run skips with the capability it lacks.
"""

from __future__ import annotations

from pdxfer.transport import registry
from pdxfer.transport.engine import EngineBase
from pdxfer.transport.testing import conformance, registry_backends

# transitional: the backends already on the kit
ON_KIT = [b for b in registry_backends() if issubclass(registry._class(b.spawn[0]), EngineBase)]
globals().update(conformance(ON_KIT))
