"""close() joins every thread it started, and a process that used engines exits 0.

Issue #9 item 13: a script that made two engines, moved a table and closed
them could die at interpreter exit with `terminate called without an active
exception` (SIGABRT) — a thread of ours still running native code while the
runtime tore down. The in-process test pins the cause (no thread an engine
started outlives its close); the subprocess test pins the symptom.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from pdxfer import transport

SCRIPT = pathlib.Path(__file__).with_name("exit_script.py")


@pytest.mark.parametrize("backend", transport.available())
def test_close_joins_every_thread_it_started(backend: str) -> None:
    before = set(threading.enumerate())
    a, b = transport.create(backend), transport.create(backend)
    nbytes = 32 << 20  # over loopback's PARALLEL_MIN in 64 rows: its copy helpers run
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    local, remote = a.register(src), b.register(dst)
    step = nbytes // 64
    table = np.stack([np.arange(64) * step, np.arange(64) * step, np.full(64, step)], 1)
    a.connect(b.address()).write(local, remote.descriptor(), table.astype(np.int64)).wait(60)
    assert bool(dst.all())
    a.close()
    b.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads still running after close(): {left}"


@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_engines_then_exit_returns_0_every_time(backend: str) -> None:
    # once in a fresh interpreter, then 10 forked children (20 exits over both backends):
    # every exit code must be 0, never 134 / -6 (SIGABRT)
    fresh = subprocess.run([sys.executable, str(SCRIPT), backend, "16"],
                           capture_output=True, text=True, timeout=100)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    forked = subprocess.run([sys.executable, str(SCRIPT), backend, "16", "10"],
                            capture_output=True, text=True, timeout=100)
    assert forked.returncode == 0, forked.stderr[-3000:]
    codes = json.loads(forked.stdout.strip().splitlines()[-1])
    assert codes == [0] * 10, (codes, forked.stderr[-3000:])
