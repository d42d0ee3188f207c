"""Hostile `pdxfer bench` command lines: a usage error (exit 2, one `error:` line), never a traceback.

Every line here once ended in a traceback or started measuring before
failing (#35 item 8: `--json` at a directory failed after the bench ran,
`--peers nan`, `--backends tcp,,tcp`, `--ttl 1e30`, `--etcd http://[`...).
Each flag must be refused at the argparse edge, before any work: the bench's
first act of work, printing the machine line above its table, raises here,
so a line that gets past validation fails the test instead of running.
"""

from __future__ import annotations

import shlex

import pytest

from pdxfer import cli
from pdxfer.bench import directory as bench_directory
from pdxfer.bench import report

# (command line, what its one error line must say)
HOSTILE = [
    ("bench transport --tiny --json /tmp", "--json /tmp is a directory; name a file in it"),
    ("bench transport --tiny --plot /tmp", "--plot /tmp is a directory"),
    ("bench transport --json /nonexistent/x.json", "directory /nonexistent does not exist"),
    ("bench transport --backends tcp,,tcp", "--backends: 'tcp,,tcp' has an empty item"),
    ("bench transport --backends tcp,tcp", "--backends: 'tcp,tcp' names 'tcp' twice"),
    ("bench transport --backends ,", "--backends: ',' has an empty item"),
    ("bench transport --backends pigeon", "backends ['pigeon'] are not installed"),
    ("bench transport --reps 100000000000000000000", "--reps: 100000000000000000000 is out of range"),
    ("bench transport --width 1e9", "--width: expected an integer, got '1e9'"),
    ("bench engine --tiny --backends tcp,tcp", "names 'tcp' twice"),
    ("bench engine --layouts pigeon", "--layouts pigeon: choose from"),
    ("bench engine --layouts ,", "--layouts: ',' has an empty item"),
    ("bench engine --requests 1e9", "--requests: expected an integer, got '1e9'"),
    ("bench peers --peers nan", "--peers: expected an integer, got 'nan'"),
    ("bench peers --peers 1,x", "--peers: expected an integer, got 'x'"),
    ("bench peers --peers 0", "--peers: 0 is out of range; it must be 1..4096"),
    ("bench peers --peers 100000", "--peers: 100000 is out of range"),
    ("bench peers --peers 1,1", "--peers: '1,1' names a value twice"),
    ("bench peers --inflight 1,,2", "--inflight: '1,,2' has an empty item"),
    ("bench peers --inflight -1", "--inflight: -1 is out of range"),
    ("bench peers --max-throughput-peers 1e3", "expected an integer, got '1e3'"),
    ("bench elastic --threads 1e20", "--threads: expected an integer, got '1e20'"),
    ("bench elastic --threads 100000000000000000000", "--threads: 100000000000000000000 is out of range"),
    ("bench elastic --json /tmp", "--json /tmp is a directory"),
    ("bench directory --ttl 1e30", "--ttl: 1e30 is out of range; it must be a number in 1..86400"),
    ("bench directory --ttl 0.5", "--ttl: 0.5 is out of range"),
    ("bench directory --ttl nan", "--ttl: nan is out of range"),
    ("bench directory --departure-ttl 1e30", "--departure-ttl: 1e30 is out of range"),
    ("bench directory --etcd http://[", "--etcd: 'http://[' is not a URL"),
    ("bench directory --etcd notaurl", "--etcd: 'notaurl' is not an etcd client URL"),
    ("bench directory --etcd http://127.0.0.1", "is not an etcd client URL; give http://HOST:PORT"),
    ("bench directory --peers 1", "--peers: 1 is out of range"),
    ("bench chunked --compute-ms 1e30", "--compute-ms: 1e30 is out of range"),
    ("bench chunked --compute-ms nan", "--compute-ms: nan is out of range"),
    ("bench chunked --backends tcp,tcp", "names 'tcp' twice"),
    ("bench layerwise --tokens 100", "--tokens: every size must be a multiple of 16 in 16..65536"),
    ("bench layerwise --tokens 1,x", "--tokens: '1,x' is not a comma-separated list of ints"),
    ("bench layerwise --us-per-token-layer nan", "--us-per-token-layer: nan is out of range"),
    ("bench layerwise --layers 1", "--layers: 1 is out of range"),
    ("bench scaling --reps 100000000000000", "--reps: 100000000000000 is out of range"),
    ("bench scaling --backends tcp,", "has an empty item"),
    ("bench request-cost --latency 100000000000000000000000", "--latency: 100000000000000000000000 is out of range"),
    ("bench layouts --backends pigeon", "backends ['pigeon'] are not installed"),
    ("bench tp --backends tcp,tcp", "names 'tcp' twice"),
    ("bench tp --heads 7", "--heads: 7 is out of range"),
    ("bench transport --connect localhost", "--connect: 'localhost' has no port; give HOST:PORT"),
    ("bench transport --connect :7400", "--connect: ':7400' has no host; give HOST:PORT"),
    ("bench transport --connect h:x", "--connect: 'h:x': the port 'x' is not a number"),
    ("bench engine --connect h:0", "--connect: 'h:0': port 0 is out of range; it must be 1..65535"),
    ("bench transport --listen 70000", "--listen: '70000': port 70000 is out of range; it must be 0..65535"),
    ("bench engine --listen x", "--listen: 'x': the port 'x' is not a number"),
    ("bench transport --listen :7400", "--listen: ':7400' has an empty host"),
    ("bench transport --listen 0 --connect h:1", "argument --connect: not allowed with argument --listen"),
    ("bench transport --listen 0 --processes 2", "--processes 2 with --listen: the receiving side is"),
    ("bench engine --connect h:1 --processes 2", "--processes 2 with --connect"),
    ("bench transport --listen 0 --json /tmp/x.json", "--json with --listen: the results print on the --connect side"),
]


class _Started(AssertionError):
    """The bench got past its argument checks and began measuring."""


@pytest.fixture(autouse=True)
def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started() -> str:
        raise _Started("the bench started work before refusing the line")

    monkeypatch.setattr(report, "machine_line", started)
    monkeypatch.setattr(bench_directory, "machine_line", started)


@pytest.mark.parametrize(("line", "message"), HOSTILE, ids=[line for line, _ in HOSTILE])
def test_hostile_line_is_a_one_line_usage_error(line: str, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(shlex.split(line))
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    assert err.strip().splitlines()[-1] == errors[0], err  # the error is the last word
    assert message in errors[0], err
    assert not out  # nothing measured, nothing printed


def test_bench_directory_with_no_etcd_there_says_so_in_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: 63 s of every simulated peer's connect wait, then an AssertionError (#34 item 4).
    import socket
    import time

    # The first-contact wait shortened from its 10 s: what is tested is that it is one bounded
    # wait and one line, not how long the bound is.
    monkeypatch.setattr(bench_directory, "_CONNECT_S", 2.0)

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    assert cli.main(["bench", "directory", "--tiny", "--etcd", url]) == 1
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not out
    waiting, error = err.strip().splitlines()
    assert waiting == f"waiting for etcd at {url} (up to {bench_directory._CONNECT_S:.0f} s)"
    assert error.startswith(f"error: no etcd answers at {url} within 2 s (")
    assert "Connection refused" in error
    assert elapsed < bench_directory._CONNECT_S + 15, f"took {elapsed:.0f} s"
