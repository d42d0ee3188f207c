"""The cluster example end to end: etcd, 2 prefill x 2 decode worker processes, a router, a kill.

One launcher run (its four workers and etcd are real processes, ~10 s on two
cores) with `--kill-prefill`: it covers the normal path (every request routed
through the directory, outputs identical) and the fault (p0 SIGKILLed with a
request in flight: that request and any routed to p0 before its lease expired
are retried on p1; the directory drops p0 within its lease).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "directory"))

from etcd_kit import etcd_binary  # noqa: E402


def test_two_by_two_with_a_killed_prefill_completes_every_request_identically(launcher_run) -> None:
    etcd_binary()  # skip here without one (fail under CI=true); the launcher finds the same
    # The second run docs/directory.md shows: made once for both (tests/conftest.py).
    proc = launcher_run("examples.launch_cluster", ["--prefill", "2", "--decode", "2",
                        "--requests", "6", "--ttl", "1", "--kill-prefill"], timeout=200)
    out = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert proc.returncode == 0, out
    assert "outputs identical: all 6 requests match" in out, out
    routed = re.findall(r"^(req-\d+)\s+-> prefill (p\d) \(engine (tcp-\w+)", out, re.M)
    assert {p for _, p, _ in routed} == {"p0", "p1"}, out  # both instances served
    assert re.search(r"^killed prefill p0 \(pid \d+\) with (req-\d+) in flight", out, re.M), out
    retried = re.findall(r"^(req-\d+)\s+failed on prefill p0: .*; retrying elsewhere", out, re.M)
    assert retried, out
    for rid in retried:  # each retried request was then routed to p1
        assert (rid, "p1") in {(r, p) for r, p, _ in routed}, out
    down = re.search(r"^p0 is down ([\d.]+) s after the kill \(lease 1.0 s\): the router picks "
                     r"from \['p1'\]", out, re.M)
    assert down and float(down.group(1)) < 1 + 1.0, out
    pids = {int(p) for p in re.findall(r"worker pid (\d+)", out)}
    assert len(pids) == 4, out
    assert not [pid for pid in pids if _exists(pid)], "a worker outlived the launcher"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
