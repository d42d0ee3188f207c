"""The example launcher and workers refuse bad flags in one line naming the flag, before starting anything."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from examples import decode_worker, launch_pd, launch_tp, prefill_worker
from pdxfer import transport


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


# Every launch_pd flag is honoured or refused in every mode (#34 item 2): with
# --prefill-tp/--decode-tp the TP launcher used parse_known_args and ran tcp on
# CPU whatever --transport/--device/--kill-prefill-after said, exiting 0.
@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill-tp", "2", "--transport", "pigeon"], "transport 'pigeon' is not installed here"),
    (["--decode-tp", "2", "--transport", "loopback"],
     "--transport loopback: every TP rank is its own process"),
    (["--prefill-tp", "2", "--device", "cuda"], "--device cuda: the TP example runs its ranks on CPU"),
    (["--prefill-tp", "2", "--kill-prefill-after", "0"],
     "--kill-prefill-after is not supported with --prefill-tp/--decode-tp"),
    (["--prefill-tp", "2", "--resize-every", "1"],
     "--resize-every is not supported with --prefill-tp/--decode-tp"),
    (["--prefill-tp", "2", "--verbose"], "--verbose is not supported with --prefill-tp/--decode-tp"),
    (["--prefill-tp", "2", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--prefill-tp", "3"], "--prefill-tp 3 must divide the model's 8 heads"),
    (["--prefill-tp", "0"], "--prefill-tp: 0 is out of range"),
    (["--prefill-tp", "2", "--requests", "0"], "--requests: 0 is out of range"),
    (["--prefill-tp", "2", "--timeout", "nan"], "--timeout: nan is out of range"),
    (["--prefill-tp", "2", "--prompt-len", "100000"],
     "over the toy model's 4,096 positions: its attention holds a dense 8 x n x n float32 score "
     "matrix (320.0 GB for this prompt"),
])
def test_tp_mode_refuses_what_it_would_ignore(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(launch_pd.main, argv, capsys)
    assert message in line
    assert line.startswith("python -m examples.launch_pd: error: ")  # the command typed


def test_prompt_len_past_the_attention_budget_names_the_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Was: an 80 GB allocation attempt inside the reference run.
    line = _usage_error(launch_pd.main, ["--prompt-len", "100000"], capsys)
    assert ("--prompt-len 100000 --gen-len 8: 100,000 prompt + 8 generated tokens are over the toy "
            "model's 8,192 positions") in line and "(80.0 GB for this prompt" in line


def test_kill_prefill_after_with_an_in_process_transport_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(launch_pd.main, ["--transport", "loopback", "--kill-prefill-after", "0"],
                        capsys)
    assert "--kill-prefill-after needs a cross-process transport" in line


@pytest.mark.parametrize("variant", transport.variants())
def test_named_variants_are_accepted(variant: str) -> None:
    # `nixl-all` (the README's one-host GPU backend) was refused as "not installed".
    assert launch_pd.parse_args(["--transport", variant]).transport == variant
    assert launch_tp.parse_args(["--transport", variant]).transport == variant


def test_there_is_a_variant_to_accept() -> None:
    # The parametrized test above runs nothing where no variant imports: say so.
    assert transport.variants(), "no named variant (nixl-all, ucx-all) imports here"


# A decode worker whose prefill is absent, mis-addressed or mismatched says
# "waiting for ..." at once and then ONE line naming the cause (#34 item 4);
# it was silent for 30 s and then printed a 33-line traceback.
@pytest.fixture(scope="module")
def tcp_prefill():
    from examples.caches import PoolSizes
    from examples.serving import WorkerOptions

    threads = torch.get_num_threads()
    worker = prefill_worker.PrefillWorker(WorkerOptions(
        transport="tcp", device="cpu", sizes=PoolSizes(kv_pages=8, state_entries=2), timeout=2.0))
    serving = threading.Thread(target=worker.serve_forever, daemon=True)
    serving.start()
    try:
        yield worker.ready_info()
    finally:
        worker.close()
        serving.join(10)
        torch.set_num_threads(threads)


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _decode_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    threads = torch.get_num_threads()
    try:
        assert decode_worker.main(argv) == 1
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not out
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    return lines


def test_decode_without_a_prefill_says_it_waits_then_why_it_gave_up(
        capsys: pytest.CaptureFixture[str]) -> None:
    port = _closed_port()
    waiting, error = _decode_fails(["--prefill", f"127.0.0.1:{port}", "--timeout", "0.5"], capsys)
    assert waiting == f"waiting for the prefill worker at 127.0.0.1:{port} (up to 2 s)"
    assert error.startswith(f"error: no prefill worker at 127.0.0.1:{port} within 2 s")
    assert "Connection refused" in error and "python -m examples.prefill_worker" in error


def test_decode_pointed_at_the_bootstrap_port_says_which_address_to_pass(
        tcp_prefill, capsys: pytest.CaptureFixture[str]) -> None:
    _, error = _decode_fails(["--prefill", tcp_prefill["bootstrap"], "--timeout", "2"], capsys)
    assert error.startswith(f"error: {tcp_prefill['bootstrap']} answered, but not as a prefill "
                            "worker's RPC port")
    assert "pass --prefill the 'rpc' address of its readiness line, not its 'bootstrap'" in error


def test_decode_with_another_transport_names_both(tcp_prefill,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    other = next(n for n in transport.available() + transport.variants()
                 if n != "tcp" and launch_pd.cross_process(n))
    _, error = _decode_fails(["--prefill", tcp_prefill["rpc"], "--transport", other,
                              "--timeout", "2"], capsys)
    assert error == (f"error: prefill worker uses transport 'tcp', this decode worker {other!r}; "
                     "pass the same --transport to both")


def test_decode_prefill_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(decode_worker.main, ["--prefill", "localhost"], capsys)
    assert "argument --prefill: expected HOST:PORT (the 'rpc' of the prefill worker's readiness " \
           "line), got 'localhost'" in line
