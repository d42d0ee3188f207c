"""The workers' refusals and the example RPC, in one process over loopback.

Cheap: no child processes. The workers are the same classes the launcher
starts as processes; here they serve from threads (as the launcher does for
a transport that cannot cross processes), and requests go in through their
RPC servers or straight to `handle`.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from pdxfer.transport.errors import PeerLostError, ProtocolError
from pdxfer.transport.wire import ErrorMessage

from examples import launch_pd
from examples.caches import PoolSizes
from examples.decode_worker import DecodeWorker
from examples.model import ModelConfig
from examples.prefill_worker import PrefillWorker
from examples.rpc import (
    PROTOCOL,
    Failed,
    Generate,
    Hello,
    Prefill,
    RpcClient,
    RpcServer,
    TransferFigures,
    parse_hostport,
)
from examples.serving import WorkerOptions

OPTS = WorkerOptions(transport="loopback", sizes=PoolSizes(kv_pages=8, state_entries=2),
                     timeout=3.0)


@pytest.fixture(scope="module")
def workers():
    prefill = PrefillWorker(OPTS)
    decode = None
    try:
        decode = DecodeWorker(OPTS, _serve(prefill))
        _serve(decode)
        yield prefill, decode
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


def _serve(worker) -> str:
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    return worker.ready_info()["rpc"]


def test_decode_refuses_bad_requests_with_the_reason(workers) -> None:
    _, decode = workers
    bad_token = decode.handle(Generate(request_id="r1", prompt=[3, 999], gen_len=2))
    assert isinstance(bad_token, Failed)
    assert re.search(r"1 token\(s\) outside 0\.\.95, e\.g\. 999", bad_token.reason)
    too_long = decode.handle(Generate(request_id="r2", prompt=[1] * 40, gen_len=4))
    assert isinstance(too_long, Failed)
    assert "pool 'kv' has 8 of 8 entries free, a request needs 11" in too_long.reason
    assert "--kv-pages" in too_long.reason
    assert isinstance(decode.handle(Generate(request_id="r3", prompt=[1], gen_len=0)), Failed)


def test_prefill_refuses_destinations_that_do_not_fit_and_keeps_its_entries(workers) -> None:
    prefill, _ = workers
    free = prefill.caches.allocators["kv"].free
    sizes = {"kv": 8, "state": 2, "aux": 2}
    past_end = prefill.handle(Prefill("p1", [1, 2, 3], {"kv": [8], "state": [0], "aux": [0]}, sizes))
    assert isinstance(past_end, Failed)
    assert re.search(r"index 8\b.*8 entries", past_end.reason)
    too_many = prefill.handle(Prefill("p2", [1, 2, 3], {"kv": [1, 2], "state": [0], "aux": [0]}, sizes))
    assert isinstance(too_many, Failed)
    assert "pool 'kv': the prompt fills 1 entries, decode offered 2" in too_many.reason
    assert prefill.caches.allocators["kv"].free == free


def test_a_refused_request_leaves_the_workers_serving(workers) -> None:
    _, decode = workers
    client = RpcClient(decode.ready_info()["rpc"], timeout=10)
    try:
        assert isinstance(client.call(Generate(request_id="x", prompt=[], gen_len=1)), Failed)
        done = client.call(Generate(request_id="y", prompt=[5, 6, 7, 8, 9], gen_len=3))
        assert done.request_id == "y" and len(done.tokens) == 3
    finally:
        client.close()


def test_decode_refuses_a_prefill_serving_another_model(workers) -> None:
    prefill, _ = workers
    with pytest.raises(RuntimeError, match=r"prefill worker at .* serves model \w+, this decode worker \w+"):
        DecodeWorker(OPTS, prefill.ready_info()["rpc"], cfg=ModelConfig(seed=1))


def test_loopback_runs_the_launcher_with_in_process_workers(capsys) -> None:
    rc = launch_pd.main(["--transport", "loopback", "--requests", "2", "--prompt-len", "9",
                         "--gen-len", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "outputs identical: all 2 requests match" in out


def test_rpc_server_reports_handler_errors_and_refuses_garbage() -> None:
    def handler(msg):
        raise KeyError("boom")

    server = RpcServer("127.0.0.1", 0, handler, log=lambda m: None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.address
    try:
        client = RpcClient(f"{host}:{port}", timeout=5)
        reply = client.call(Hello())
        assert isinstance(reply, Failed) and "KeyError('boom')" in reply.reason
        client.close()
        with socket.create_connection((host, port), timeout=5) as raw:
            raw.sendall(b"\xff\xff\xff\xff")  # a 4 GiB frame: refused before reading it
            refusal = PROTOCOL.recv(raw)
            assert isinstance(refusal, ErrorMessage)
            assert "frame length 4294967295 B exceeds the 1048576 B limit" in refusal.reason
            with pytest.raises(PeerLostError):
                PROTOCOL.recv(raw)
    finally:
        server.close()
    with pytest.raises(ProtocolError, match="not a pdxfer-example message"):
        PROTOCOL.pack(object.__new__(type("X", (), {"TYPE": "x"})))


def test_hostport_parsing_says_what_it_wants() -> None:
    assert parse_hostport("10.0.0.2:7000") == ("10.0.0.2", 7000)
    with pytest.raises(ValueError, match="expected HOST:PORT, got '7000'"):
        parse_hostport("7000")


def test_a_mismatch_is_reported_and_fails_the_run(capsys) -> None:
    fig = TransferFigures(nbytes=100, segments=1, layer_major_segments=3, transfer_s=0.001)
    outs = [launch_pd.Outcome("req-0", [1, 2], [1, 2], fig),
            launch_pd.Outcome("req-1", [1, 2], [1, 3], fig)]
    assert "MISMATCH: expected [1, 2], got [1, 3]" in launch_pd.row(outs[1])
    assert launch_pd.summary(outs) is False
    out = capsys.readouterr().out
    assert "MISMATCH: 1 of 2 outputs differ from the single-process run: req-1" in out
    assert "outputs identical" not in out


def test_a_prefill_refusal_fails_the_request_fast_and_frees_decode_entries() -> None:
    # Prefill's pool is too small for the prompt; decode has already expected
    # the request, so this exercises decode's abort of an expected request.
    small = WorkerOptions(transport="loopback", sizes=PoolSizes(kv_pages=2, state_entries=2),
                          timeout=3.0)
    prefill = PrefillWorker(small)
    decode = None
    try:
        decode = DecodeWorker(OPTS, _serve(prefill))
        started = time.monotonic()
        reply = decode.handle(Generate(request_id="big", prompt=list(range(16)), gen_len=2))
        assert isinstance(reply, Failed)
        assert "pool 'kv' has 2 of 2 entries free, a request needs 4" in reply.reason
        assert time.monotonic() - started < 2.5  # well inside the 3 s engine timeout
        assert decode.caches.allocators["kv"].free == OPTS.sizes.kv_pages
        ok = decode.handle(Generate(request_id="small", prompt=[1, 2, 3], gen_len=2))
        assert ok.request_id == "small" and len(ok.tokens) == 2
    finally:
        if decode is not None:
            decode.close()
        prefill.close()
