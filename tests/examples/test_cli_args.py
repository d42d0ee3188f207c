"""The example launcher and workers refuse bad flags in one line naming the flag, before starting anything."""

from __future__ import annotations

import socket

import pytest
import torch

from examples import decode_worker, launch_pd, prefill_worker


def _usage_error(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--requests", "0"], "--requests: 0 is out of range; it must be at least 1"),
    (["--prompt-len", "-3"], "--prompt-len: -3 is out of range"),
    (["--timeout", "0"], "--timeout: 0 is out of range; it must be a finite number > 0"),
    (["--requests", "2", "--kill-prefill-after", "2"], "--kill-prefill-after 2 names no request"),
    (["--transport", "pigeon"], "transport 'pigeon' is not installed here"),
])
def test_launcher_flag_ranges(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _usage_error(launch_pd.main, argv, capsys)


@pytest.mark.parametrize("main", [prefill_worker.main, launch_pd.main])
def test_cuda_without_cuda(main, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no CUDA device; use --device cpu" in _usage_error(main, ["--device", "cuda"], capsys)


@pytest.mark.parametrize(("main", "flag", "extra"), [
    (prefill_worker.main, "--port", []),
    (prefill_worker.main, "--bootstrap-port", []),
    (prefill_worker.main, "--data-port", []),
    (decode_worker.main, "--port", ["--prefill", "127.0.0.1:1"]),
])
def test_worker_names_the_flag_whose_port_is_taken(main, flag: str, extra: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = _usage_error(main, [flag, str(port), *extra], capsys)
    assert f"{flag} {port}: that port is already in use on 127.0.0.1; pass another {flag}" in line


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-pages", "0"], "--kv-pages: 0 is out of range"),
    (["--port", "70000"], "--port: 70000 is out of range; it must be 0..65535"),
])
def test_worker_flag_ranges(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _usage_error(prefill_worker.main, argv, capsys)
