"""`pdxfer` behaves like a tool: misuse is argparse's one-line error and exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdxfer import cli


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "message"), [
    ([], "the following arguments are required: command"),
    (["foo"], "invalid choice: 'foo'"),
    (["bench"], "the following arguments are required: which"),
    (["bench", "transprot"], "invalid choice: 'transprot' (choose from 'transport', 'engine', 'layouts', "
                             "'request-cost', 'tp', 'chunked', 'layerwise', 'scaling', 'elastic', "
                             "'directory', "
                             "'peers')"),
    (["layout"], "pass --example"),
    (["layout", "--example", "--pages", "5000"], "--pages: '5000': give 1..1024 distinct pages, each 0..1023"),
    (["layout", "--example", "--slot", "-1"], "--slot: -1 is out of range; it must be 0..63"),
    (["bench", "transport", "--total-mib", "-1"], "--total-mib: -1 is out of range; it must be 4..65536"),
    (["bench", "transport", "--reps", "0"], "--reps: 0 is out of range"),
    (["bench", "transport", "--backends", "carrier-pigeon"], "are not installed"),
    (["bench", "engine", "--requests", "0"], "--requests: 0 is out of range; it must be 1..10000000"),
    (["bench", "engine", "--backends", "carrier-pigeon"], "are not installed"),
    (["bench", "layouts", "--reps", "0"], "--reps: 0 is out of range"),
    (["bench", "layouts", "--backends", "pigeon"], "backends ['pigeon'] are not installed"),
    (["bench", "layouts", "--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: directory"),
    (["bench", "transport", "--width", "-3"], "--width: -3 is out of range; it must be 0..10000"),
    (["bench", "tp", "--reps", "0"], "--reps: 0 is out of range"),
    (["bench", "tp", "--layers", "x"], "--layers: expected an integer, got 'x'"),
    (["bench", "tp", "--heads", "12"], "--heads 12: must be a multiple of 8"),
    (["bench", "tp", "--pages", "4", "--request", "5"], "--request 5 exceeds --pages 4"),
    (["bench", "tp", "--backends", "pigeon"], "backends ['pigeon'] are not installed"),
    (["bench", "tp", "--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: directory"),
    (["bench", "chunked", "--backends", "pigeon"], "backends ['pigeon'] are not installed"),
])
def test_misuse_is_a_one_line_usage_error(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    last = _fails(argv, capsys)
    assert last.startswith("pdxfer"), last
    assert message in last


def test_help_and_version_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["bench", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "pdxfer bench layouts" in out
    assert f"pdxfer {cli.version()}" in out
    assert cli.version()[0].isdigit()  # installed by `make setup`: a real version, not "unknown"


def test_console_script_version_matches_metadata() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdxfer", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"pdxfer {cli.version()}"


def test_cuda_device_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import torch

    from pdxfer.cliargs import device_name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError, match=r"'cuda' asked for, but this torch .* sees no CUDA device; use --device cpu"):
        device_name("cuda")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown device 'tpu'"):
        device_name("tpu")
    assert device_name("CPU") == "cpu"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["bench", "--help"]])
def test_version_and_help_answer_without_importing_torch(argv: list[str]) -> None:
    """A tool's first answer is instant: no torch (a second or more to import), nor numpy."""
    probe = ("import sys\nfrom pdxfer import cli\n"
             f"try:\n    cli.main({argv!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
             "heavy = sorted(m for m in ('torch', 'numpy', 'msgpack') if m in sys.modules)\n"
             "print('HEAVY', code, heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "HEAVY 0 []", proc.stderr
