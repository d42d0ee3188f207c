"""Ctrl-C on a bench: 'interrupted after k of N', the samples so far in --json, exit 130 (#34 item 3).

A real `pdxfer bench engine` process gets a real SIGINT once it has printed
its first table row; it used to print a traceback and lose every result.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_ctrl_c_says_how_far_it_got_and_writes_the_partial_json(tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdxfer", "bench", "engine", "--backends", "loopback,tcp",
         "--requests", "400", "--batch", "20", "--width", "0", "--json", str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the first row of the table: one case done
            if line.startswith("| loopback"):
                break
        else:
            raise AssertionError(f"no table row; stderr:\n{proc.stderr.read()}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    got = re.search(r"^interrupted after (\d+) of 6 configurations$", err, re.M)
    # The row prints just before the case counts as done: 0 or more, never all 6.
    assert got and int(got[1]) < 6, err
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and data["bench"] == "engine"
    assert data["samples"], "the finished case's samples are in the partial JSON"


@pytest.mark.timeout(300)
def test_ctrl_c_in_a_terminal_reaches_the_bench_not_its_child() -> None:
    # A terminal signals its whole foreground process group: the decode side's child
    # process printed a KeyboardInterrupt traceback of its own under the bench's line.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdxfer", "bench", "engine", "--backends", "tcp", "--processes", "2",
         "--requests", "400", "--batch", "20", "--width", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # the first row: the child is up and serving
            if line.startswith("| tcp"):
                break
        else:
            raise AssertionError(f"no table row; stderr:\n{proc.stderr.read()}")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and re.search(r"^interrupted after \d+ of 3 configurations$", err, re.M), err
