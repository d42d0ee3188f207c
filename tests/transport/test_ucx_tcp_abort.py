"""UCX's tcp teardown abort, forced every run, survived (#35.7, #29.7).

`benchmarks/ucx_tcp_abort_repro.py` puts two workers made the way pdxfer's
ucx engine makes them (`lib.context`, `lib.worker`, `lib.endpoint`) into
the window the crash hunt hit about once in 400–1,900 runs: the peer's
connection to the victim's worker is set up, the peer dies, then the victim
makes its own endpoint to it. With UCX's default blocking tcp connect, every
run of this dies (SIGSEGV in `close_blocking`, or with a send queued the
hunt's SIGABRT in `uct_tcp_ep_pending_purge`); with `lib.context`'s
non-blocking connect the endpoint fails through UCX's error handling and the
victim lives. Each run must also show it reached the window (the endpoint
failed), so a repro that drifted out of it cannot pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdxfer import transport

pytestmark = pytest.mark.skipif("ucx" not in transport.available(),
                                reason="ucxx-cu12 is not installed (pip install 'pdxfer[ucx]')")

REPRO = Path(__file__).resolve().parents[2] / "benchmarks" / "ucx_tcp_abort_repro.py"
RUNS = 2  # one without, one with a queued send: before the fix each run died (40 of 40)


@pytest.mark.timeout(240)
def test_a_peer_dying_between_two_connection_setups_does_not_kill_the_victim() -> None:
    out = subprocess.run([sys.executable, str(REPRO), "--runs", str(RUNS), "--both"],
                         capture_output=True, text=True, timeout=220)
    summary = [line for line in out.stdout.splitlines() if line.startswith("runs ")]
    assert summary, f"the repro printed no summary (exit {out.returncode}): {out.stderr[-3000:]}"
    assert summary[0].startswith(f"runs {RUNS} aborts 0 not-reached 0"), (
        out.stdout, out.stderr[-3000:])
    assert out.returncode == 0
