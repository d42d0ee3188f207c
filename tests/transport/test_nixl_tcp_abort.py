"""UCX's tcp teardown abort under NIXL, forced every run, survived (#35.7, #29.7).

NIXL bundles its own UCX, with the tcp bug the ucx backend's
`test_ucx_tcp_abort.py` guards against: `benchmarks/nixl_tcp_abort_repro.py`
makes two agents the way the nixl engine does (`agent.make_agent`, tls tcp)
and lets the peer connect to the victim, stop, be accepted and die before
the victim loads it (its endpoint to the dead peer). With UCX's blocking
tcp connect the victim died in every run (SIGABRT, 40 of 40); with
`make_agent`'s `TCP_CONN_NB=y` its WRITE to the peer fails through UCX's
error handling and it lives. Each run must also show it reached the window
(the WRITE failed), so a repro that drifted out of it cannot pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdxfer import transport

pytestmark = pytest.mark.skipif(
    "nixl" not in transport.available(), reason="nixl-cu12 is not installed (pip install nixl-cu12)")

REPRO = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_tcp_abort_repro.py"
RUNS = 2  # one without, one with the WRITE queued at once: before the fix each run died


@pytest.mark.timeout(240)
def test_a_peer_dying_between_two_connection_setups_does_not_kill_a_nixl_agent() -> None:
    out = subprocess.run([sys.executable, str(REPRO), "--runs", str(RUNS), "--both"],
                         capture_output=True, text=True, timeout=220)
    summary = [line for line in out.stdout.splitlines() if line.startswith("runs ")]
    assert summary, f"the repro printed no summary (exit {out.returncode}): {out.stderr[-3000:]}"
    assert summary[0].startswith(f"runs {RUNS} aborts 0 not-reached 0"), (
        out.stdout, out.stderr[-3000:])
    assert out.returncode == 0
