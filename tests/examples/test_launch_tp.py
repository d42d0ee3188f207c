"""The heterogeneous-TP example end to end: one process per rank, outputs checked.

Four launcher runs (4->2, 2->4, 8->1 and an MLA-style replicated 4->1) start
at once; each forks its rank processes (24 in all, every one a real process
with its own engine and gloo group) instead of starting interpreters that
would import torch 24 times. Each run must print "outputs identical" and
per-request segment counts equal to entries (merged runs) x contributing rank
pairs, which the launcher checks and this test reads back.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "4to2": ["--prefill-tp", "4", "--decode-tp", "2"],
    "2to4": ["--prefill-tp", "2", "--decode-tp", "4"],
    "8to1": ["--prefill-tp", "8", "--decode-tp", "1"],
    "replicated-4to1": ["--prefill-tp", "4", "--decode-tp", "1", "--replicated"],
}


def test_hetero_tp_runs_match_the_monolithic_run() -> None:
    procs = {
        name: subprocess.Popen(
            # Through launch_pd, which hands --prefill-tp/--decode-tp to launch_tp.
            [sys.executable, "-m", "examples.launch_pd", *flags, "--requests", "1",
             "--prompt-len", "10", "--gen-len", "3", "--timeout", "30"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, flags in CASES.items()
    }
    outs = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=400)
            outs[name] = (proc.returncode, stdout + "\n--- stderr ---\n" + stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (code, out) in outs.items():
        assert code == 0, f"{name}:\n{out}"
        rows = re.findall(r"^req-0\s+([\d,]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+identical", out, re.M)
        assert len(rows) == 1, f"{name}:\n{out}"
        nbytes, segments, expected, pairs = rows[0]
        assert int(segments) == int(expected) and int(nbytes.replace(",", "")) > 0, out
        assert "outputs identical: all 1 requests match the monolithic run" in out, out
    # 8 -> 1: eight pairs, one per prefill rank; 2 -> 4: one per decode rank.
    assert re.search(r"^req-0\s+\S+\s+\d+\s+\d+\s+8\s", outs["8to1"][1], re.M)
    assert re.search(r"^req-0\s+\S+\s+\d+\s+\d+\s+4\s", outs["2to4"][1], re.M)
    assert re.search(r"^req-0\s+\S+\s+\d+\s+\d+\s+1\s", outs["replicated-4to1"][1], re.M)
