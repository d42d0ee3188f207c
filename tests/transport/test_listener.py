"""The listener's address family, and a fuzz of every listening backend's listener, RSS measured.

The listener's guarantees (pre-handshake frame cap, pending cap, deadlines,
IPv6, close reaching a pending connection, bounded dials) are kit cases,
run over every backend that `listens` (tests/transport/test_kit_conformance.py).
What stays here: the address-family rule, and issue #9's adversary measured
from inside the engine's process — a peer that announces a large frame and
stalls must cost what it sent, not what it announced.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest
from pdxfer.transport.listener import family_for

from pdxfer import transport

# Every listening backend shares the kit's one Listener and first-frame read; the fuzz (a
# subprocess, ~10 s each) runs on tcp (it alone has the post-handshake case) and nixl (the
# largest control frame), as before the kit; the kit's listener cases run on all of them.
LISTENING = [name for name in ("tcp", "nixl") if name in transport.available()]
FUZZ = pathlib.Path(__file__).with_name("fuzz_listeners.py")
RSS_BOUND_MIB = 50


@pytest.mark.parametrize("backend", LISTENING)
def test_fuzzing_the_listener_leaves_rss_within_bound(backend: str) -> None:
    proc = subprocess.run([sys.executable, str(FUZZ), backend], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["case"] for r in rows} >= {"announce", "garbage", "storm"}
    for row in rows:
        assert row["rss_growth_mib"] < RSS_BOUND_MIB, row
    storm = next(r for r in rows if r["case"] == "storm")
    assert storm["refused"] >= storm["connections"] // 2, storm


def test_listener_family_follows_the_host() -> None:
    assert family_for("::1") == socket.AF_INET6 and family_for("::") == socket.AF_INET6
    assert family_for("127.0.0.1") == socket.AF_INET and family_for("") == socket.AF_INET
