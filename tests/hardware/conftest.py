"""The hardware suite: runs only on a host with real pyverbs and an ACTIVE RDMA port.

Everywhere else every test here skips with the reason (on a machine without
kernel RDMA support: "no RDMA device: kernel has no InfiniBand support").
What the suite proves, the software fabric cannot: real placement order,
the fence against a real HCA's DMA, real limits and speed, GPU memory.
The conformance suite and the PD engine tests also run on "verbs" by
themselves on such a host, because `transport.available()` lists it there.
"""

from __future__ import annotations

import os

import pytest
from pdxfer.transport.verbs.nics import probe

REASON = probe()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=REASON)
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
