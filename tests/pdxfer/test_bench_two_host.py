"""The two-host benches: `--listen` on one address, `--connect` from another (#34 item 5).

Real processes over two loopback addresses, 127.0.0.2 (the listener) and
127.0.0.1 (the connecting side's source address, which the kernel picks for
a route to 127.0.0.2), so every endpoint the receiving side opens must listen
where the other host reached it: a receiver that still bound 127.0.0.1 would
show up as "receiving at 127.0.0.1" and fail the test. The connecting side
prints the table; the listener serves one run and exits 0. Two hosts running
different commands are refused with one line on both sides.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LISTEN = "127.0.0.2"
# Starting an interpreter that imports torch takes seconds on a loaded machine.
START_S = 120.0
RUN_S = 240.0


def _pdxfer(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdxfer", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _listener(bench: str, *flags: str) -> tuple[subprocess.Popen, int, list[str]]:
    """A `--listen 127.0.0.2:0` process, the port it printed, and its stderr lines so far (growing)."""
    proc = _pdxfer("bench", bench, *flags, "--listen", f"{LISTEN}:0")
    lines: list[str] = []
    bound = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "listening on" in line:
                bound.set()

    threading.Thread(target=read, daemon=True).start()
    if not bound.wait(START_S):
        proc.kill()
        raise AssertionError(f"no 'listening on' line within {START_S} s: {lines}")
    port = int(re.search(rf"listening on {re.escape(LISTEN)}:(\d+)", "\n".join(lines))[1])
    return proc, port, lines


def _finish(proc: subprocess.Popen) -> None:
    try:
        proc.wait(RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("bench", "flags", "row"), [
    ("transport", ("--tiny", "--backends", "tcp"), "| 1 x 4 MiB contiguous |"),
    ("engine", ("--tiny", "--backends", "tcp", "--layouts", "entry-major"), "| tcp | entry-major |"),
])
def test_the_same_command_on_two_addresses_measures_between_them(
        bench: str, flags: tuple[str, ...], row: str, tmp_path: Path) -> None:
    listener, port, lines = _listener(bench, *flags)
    path = tmp_path / "run.json"
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pdxfer", "bench", bench, *flags, "--width", "0",
             "--json", str(path), "--connect", f"{LISTEN}:{port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    finally:
        _finish(listener)
    assert got.returncode == 0, got.stderr[-3000:]
    assert row in got.stdout, got.stdout
    assert f"{LISTEN}:{port}" in got.stdout.splitlines()[0]  # the title names the other host
    assert listener.returncode == 0, lines
    # The receiving side listened where the connecting side reached it, not on 127.0.0.1.
    assert f"# 127.0.0.1 connected; receiving at {LISTEN}" in lines, lines
    assert lines[-1] == "# the run from 127.0.0.1 finished", lines
    data = json.loads(path.read_text())
    assert data["params"]["connect"] == f"{LISTEN}:{port}" and data["samples"]
    if bench == "transport":  # every receiving endpoint listened on the other address
        assert data["endpoints"] == {"tcp": LISTEN, "tcp 1 stream": LISTEN, "raw socket": LISTEN}


@pytest.mark.timeout(600)
def test_two_hosts_running_different_commands_are_refused_in_one_line() -> None:
    listener, port, lines = _listener("transport", "--tiny", "--backends", "tcp")
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pdxfer", "bench", "transport", "--tiny", "--backends",
             "tcp,loopback", "--connect", f"{LISTEN}:{port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    finally:
        _finish(listener)
    why = ("the two hosts run different commands: backends is ['tcp'] on the --listen host and "
           "['tcp', 'loopback'] on the --connect host; run the same command on both")
    assert got.returncode == 2 and not got.stdout, got.stderr
    assert "Traceback" not in got.stderr
    errors = [ln for ln in got.stderr.splitlines() if "error:" in ln]
    assert errors == [got.stderr.strip().splitlines()[-1]] and why in errors[0], got.stderr
    assert listener.returncode == 2
    assert lines[-1].startswith(f"error: {why}"), lines


def test_a_connect_with_nothing_listening_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from pdxfer import cli

    with socket.create_server((LISTEN, 0)) as s:
        port = s.getsockname()[1]  # closed again: nothing listens there now
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "transport", "--tiny", "--connect", f"{LISTEN}:{port}"])
    assert str(exc.value.code).startswith(f"error: --connect {LISTEN}:{port}: Connection refused")
    assert "is `pdxfer bench ... --listen` running there?" in str(exc.value.code)
