"""The conformance kit (`transport.testing`) over every configuration the registry names.

One parametrized test per kit case and configuration: loopback, tcp,
tcp fence=False, nixl, nixl-all, verbs-sim, verbs-sim fence='qp' (those that
import here), taken from `transport.registry.configurations()`. A backend
added to the registry inherits the whole kit; a case a configuration
cannot run skips with the capability it lacks.
"""

from __future__ import annotations

from pdxfer.transport.testing import conformance, registry_backends

globals().update(conformance(registry_backends()))
