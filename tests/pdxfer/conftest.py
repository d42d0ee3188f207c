"""Fixtures for the PD engine tests: one backend fixture over every transport present."""

from __future__ import annotations

import pytest
from pdxfer_testkit import BACKENDS, CROSS_PROCESS, build_pools, config

from pdxfer import DecodeEngine, PrefillEngine


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every backend `transport.available()` lists: each engine test runs over all of them."""
    return request.param


@pytest.fixture(params=CROSS_PROCESS)
def cross_backend(request) -> str:
    """Backends whose peers may live in another process (for the SIGKILL/SIGSTOP tests)."""
    return request.param


@pytest.fixture
def pair(request, backend):
    """A prefill and a decode engine over `backend`, with seeded pools; closed afterwards.

    `@pytest.mark.engine_config(**kw)` on a test or module overrides `config`'s short timeouts.
    """
    marker = request.node.get_closest_marker("engine_config")
    kw = marker.kwargs if marker is not None else {}
    src = build_pools(512, 64, seed=1)
    dst = build_pools(1024, 256, seed=2)
    prefill = PrefillEngine(src, config(backend, **kw))
    decode = DecodeEngine(dst, config(backend, **kw))
    try:
        yield prefill, decode, src, dst
    finally:
        decode.close()
        prefill.close()
