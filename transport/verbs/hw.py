"""The registry's entry for "verbs": importable only where real pyverbs sees an ACTIVE port.

`transport.available()` lists a backend whose module imports, so this
module probes at import (`nics.probe`) and raises `ImportError` with the
reason when pyverbs is missing or no port is up: "verbs" then stays out of
the list, and `transport.create("verbs")` says why.
"""

from __future__ import annotations

from .nics import probe

_reason = probe()
if _reason is not None:
    raise ImportError(_reason)

from .engine import VerbsEngine  # noqa: E402

__all__ = ["VerbsEngine"]
