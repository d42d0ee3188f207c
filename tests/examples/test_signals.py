"""Ctrl-C on the example workers: real processes, real signals, a clean close every time.

Ctrl-C in a terminal reaches the launcher and both workers at once, and the
launcher then SIGTERMs each worker: a worker gets two signals close together.
The second used to land while `serve_until_signalled` built its closer thread
and print a `KeyboardInterrupt` traceback, skipping `close()` (#34 item 3).
Here each worker gets a burst of SIGINTs and SIGTERMs right after it serves,
and must exit 0 with nothing on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from examples.serving import READY_PREFIX

ROOT = Path(__file__).resolve().parents[2]
BURST = [signal.SIGINT, signal.SIGTERM] * 10


def _start(role: str, *args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", f"examples.{role}_worker", "--device", "cpu",
                             "--kv-pages", "16", "--state-entries", "2", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith(READY_PREFIX):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"{role} worker did not get ready: {line!r}\n{err}")
    return proc, json.loads(line[len(READY_PREFIX):])


def _burst(proc: subprocess.Popen) -> tuple[int, str]:
    for sig in BURST:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            break
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rounds", [4])
def test_a_burst_of_signals_closes_each_worker_cleanly(rounds: int) -> None:
    prefill, info = _start("prefill")
    try:
        for _ in range(rounds):
            decode, _ = _start("decode", "--prefill", info["rpc"])
            code, err = _burst(decode)
            # Only the line the decode worker prints before its wait for the prefill.
            assert (code, err) == (0, f"waiting for the prefill worker at {info['rpc']} "
                                      "(up to 30 s)\n"), err
    finally:
        code, err = _burst(prefill)
    assert (code, err) == (0, ""), err


def _launcher(*args: str) -> subprocess.Popen:
    # Its own process group, which Ctrl-C in a terminal signals as a whole.
    return subprocess.Popen([sys.executable, "-m", "examples.launch_pd", "--transport", "tcp", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch load")
def test_ctrl_c_while_the_launcher_imports_is_one_line() -> None:
    # Was a 40-line KeyboardInterrupt traceback out of torch's or ucxx's import.
    proc = _launcher()
    while not _importing_torch(proc.pid):  # torch's import takes seconds: the signal lands in it
        assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # "starting" unless the launcher got past its imports first; one line either way.
    assert proc.returncode == 130 and err in ("interrupted while starting\n",
                                              "interrupted: stopping the workers\n"), err


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_workers_start_stops_them_in_one_line() -> None:
    proc = _launcher("--requests", "2")
    assert proc.stdout.readline().startswith("pdxfer PD example:")  # workers start next
    os.killpg(proc.pid, signal.SIGINT)  # the launcher and the workers it has so far
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "interrupted: stopping the workers\n"), err
