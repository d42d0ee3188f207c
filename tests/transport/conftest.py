"""The `rig` fixture every conformance test runs through, once per available backend.

A backend added to `transport.registry` (and importable here) is picked up by
`transport.available()` and inherits the whole suite; so does each configured
variant (`transport.variants()`: nixl over UCX's full transport list), whose
fence tests skip by capability with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transport_rig import Rig

from pdxfer import transport


@pytest.fixture(params=transport.available() + transport.variants())
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    try:
        yield r
    finally:
        r.close()
