"""`pdxfer probe` against a live prefill process: each cause its own exit status, and no disturbance.

The prefill is `prefill_proc.py` (a real `PrefillEngine` in a child process, its
log in a file this test reads); the probe runs as the console script does
(`cli.main`, whose return value is the process's exit status). The
stopped prefill is a second process, SIGSTOP'd, so its backlog never touches
the first one's log.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time

import pytest
from pdxfer.transport.wire import LENGTH, ErrorMessage
from pdxfer_procs import HERE, Prefill
from pdxfer_testkit import BIG_KV_FIELDS, build_pools

from pdxfer import DecodeEngine, EngineConfig, KVPoll, cli
from pdxfer.probe import Exit, probe
from pdxfer.protocol import CONTROL, VERSION, Echo, EchoDone, Hello, Refuse, Welcome
from pdxfer.session import parse_address

# The whole probe's bound: generous for two busy cores, and what a stall test waits out.
TIMEOUT = 20.0
STALL = 2.0


class LoggedPrefill:
    """A prefill process whose log the test reads line by line (`new_lines`)."""

    def __init__(self, tmp_path_factory) -> None:
        self.path = tmp_path_factory.mktemp("probe") / "prefill.log"
        self.log = open(self.path, "w")  # noqa: SIM115 — closed in stop()
        self.proc = Prefill("tcp", 0, 10.0, stderr=self.log)
        self.seen = 0

    def new_lines(self) -> list[str]:
        text = self.path.read_text()
        lines, self.seen = text[self.seen:].splitlines(), len(text)
        return lines

    def stop(self) -> None:
        self.proc.stop()
        self.log.close()


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    p = LoggedPrefill(tmp_path_factory)
    yield p
    p.stop()


def _probe(capsys, *argv: str, timeout: float = TIMEOUT) -> tuple[int, dict]:
    code = cli.main(["probe", *argv, "--json", "--timeout", str(timeout)])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def _layouts_importable(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))  # probe_layouts, as --layout names it


def test_a_matching_prefill_answers_passes_the_echo_and_is_not_disturbed(prefill, capsys) -> None:
    prefill.new_lines()
    code, out = _probe(capsys, prefill.proc.address, "--layout", "probe_layouts:matching",
                       "--bytes", "64KiB")
    assert code == Exit.OK, out
    assert out["outcome"] == "ok" and out["engine"].startswith("tcp-")
    assert (out["transport"], out["protocol"], out["differences"]) == ("tcp", VERSION, [])
    assert [e["nbytes"] for e in out["echo"]] == [4096, 65536]
    assert all(e["ok"] and e["wire_s"] > 0 and e["round_trip_s"] >= e["wire_s"] for e in out["echo"])
    # The prefill saw a decode link come and go, logged nothing, and still serves a decode.
    assert prefill.proc.ask("peers 0") == "PEERS 0"
    assert prefill.new_lines() == []
    with DecodeEngine(build_pools(256, 16, kv_fields=BIG_KV_FIELDS), EngineConfig(timeout=10.0)) as dec:
        dec.expect("after-probe", prefill.proc.address, {"kv": [3]})
        prefill.proc.send("after-probe", [5], [])
        assert dec.wait("after-probe", TIMEOUT) is KVPoll.Success
    assert prefill.proc.wait("after-probe") == "OK after-probe"
    assert prefill.new_lines() == []


def test_a_mismatched_layout_names_every_difference(prefill, capsys) -> None:
    prefill.new_lines()
    code, out = _probe(capsys, prefill.proc.address, "--layout", "probe_layouts:mismatched")
    assert code == Exit.LAYOUT_MISMATCH == 7
    assert out["outcome"] == "layout_mismatch" and out["engine"].startswith("tcp-")
    diffs = out["differences"]
    for expected in ("pool 'aux': declared by the decode only",
                     "pool 'kv': field 'k' differs in layers: 4 vs 8",
                     "pool 'kv': field 'v' differs in dtype: torch.float16 vs torch.bfloat16",
                     "pool 'state': field 'ring' differs in fill: 0.0 vs -1.0"):
        assert any(d.startswith(expected) for d in diffs), (expected, diffs)
    assert out["echo"] == []
    assert prefill.proc.ask("peers 0") == "PEERS 0"
    logged = prefill.new_lines()  # one line, as for any refused decode
    assert len(logged) == 1 and "refused" in logged[0] and "(layout)" in logged[0], logged


def test_another_transport_is_named(prefill, capsys) -> None:
    code, out = _probe(capsys, prefill.proc.address, "--layout", "probe_layouts:matching",
                       "--transport", "verbs-sim")
    assert code == Exit.TRANSPORT_MISMATCH == 6
    assert out["transport"] == "tcp" and "--transport tcp" in out["detail"]


def test_an_unreachable_port_exits_3_at_once(capsys) -> None:
    with socket.socket() as held:  # bound, never listening: a connect is refused
        held.bind(("127.0.0.1", 0))
        started = time.monotonic()
        code, out = _probe(capsys, f"127.0.0.1:{held.getsockname()[1]}",
                           "--layout", "probe_layouts:matching")
    assert code == Exit.UNREACHABLE == 3
    assert "Connection refused" in out["detail"] and out["engine"] is None
    assert time.monotonic() - started < TIMEOUT


def test_a_name_that_does_not_resolve_exits_3(capsys) -> None:
    code, out = _probe(capsys, "nosuch.invalid:7000", "--layout", "probe_layouts:matching")
    assert code == Exit.UNREACHABLE
    assert out["detail"].startswith("cannot resolve 'nosuch.invalid'")


def test_a_stopped_prefill_exits_4_within_the_timeout(tmp_path, capsys) -> None:
    with open(tmp_path / "stopped.log", "w") as log:
        stopped = Prefill("tcp", 0, 10.0, stderr=log)
        try:
            stopped.freeze()
            started = time.monotonic()
            code, out = _probe(capsys, stopped.address, "--layout", "probe_layouts:matching",
                               timeout=STALL)
            elapsed = time.monotonic() - started
        finally:
            stopped.stop()
    assert code == Exit.NO_ANSWER == 4, out
    assert out["connect_s"] is not None and out["engine"] is None
    assert "no answer to the Hello within --timeout 2 s" in out["detail"]
    assert "stopped, hung or overloaded" in out["detail"]
    assert STALL <= elapsed < TIMEOUT  # it waited out its bound, not more


def _one_shot_server(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A listener that reads one frame, answers `reply` and hangs up (a foreign peer)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            (length,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_a_prefill_of_another_protocol_version_exits_5_naming_it() -> None:
    newer = type(CONTROL)(CONTROL.name, VERSION + 1, [])  # what a newer prefill's refusal looks like
    server, thread = _one_shot_server(newer.pack(ErrorMessage(f"peer speaks pdxfer-ctl version "
                                                              f"{VERSION}, we speak {VERSION + 1}")))
    with server:
        report = probe(f"127.0.0.1:{server.getsockname()[1]}", build_pools(8, 4, kv_fields=BIG_KV_FIELDS),
                       timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert report.exit_code == Exit.PROTOCOL_MISMATCH == 5 and report.protocol == VERSION + 1
    assert f"answered in: protocol pdxfer-ctl v{VERSION + 1} (this probe: v{VERSION})" in report.text()
    assert f"speaks pdxfer-ctl version {VERSION + 1}, this probe {VERSION}" in report.detail


def test_something_that_is_not_pdxfer_exits_5() -> None:
    server, thread = _one_shot_server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with server:
        report = probe(f"127.0.0.1:{server.getsockname()[1]}", build_pools(8, 4, kv_fields=BIG_KV_FIELDS),
                       timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert report.exit_code == Exit.PROTOCOL_MISMATCH
    assert "not a pdxfer prefill's control port" in report.detail


def _scripted_prefill(answer) -> tuple[socket.socket, threading.Thread]:
    """A listener speaking the control protocol as `answer(conn, hello)` scripts it (a faulty prefill)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            answer(conn, CONTROL.recv(conn))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _probe_scripted(answer):
    server, thread = _scripted_prefill(answer)
    with server:
        report = probe(f"127.0.0.1:{server.getsockname()[1]}", build_pools(8, 4, kv_fields=BIG_KV_FIELDS),
                       timeout=TIMEOUT)
    thread.join(TIMEOUT)
    return report


def test_a_prefill_that_cannot_reach_the_probe_exits_8() -> None:
    def refuse(conn: socket.socket, hello: Hello) -> None:
        CONTROL.send(conn, Refuse("transport", "prefill cannot reach the decode's tcp endpoint "
                                  "{...}: Connection refused", "tcp-fake", "tcp", {}, {}))

    report = _probe_scripted(refuse)
    assert report.exit_code == Exit.DATA_PATH_FAILED == 8
    assert "could not open its data connection to this probe" in report.detail
    assert report.engine == "tcp-fake"


def test_an_echo_whose_bytes_never_landed_exits_8() -> None:
    """A prefill that says the echo completed without writing it: the byte check catches it."""
    def lie(conn: socket.socket, hello: Hello) -> None:
        CONTROL.send(conn, Welcome("tcp-liar", hello.pools, hello.fingerprints))
        echo = CONTROL.recv(conn)
        assert isinstance(echo, Echo)
        CONTROL.send(conn, EchoDone(echo.xid, echo.nbytes, True, "", 0.001))
        with contextlib.suppress(OSError):
            CONTROL.recv(conn)  # until the probe hangs up

    report = _probe_scripted(lie)
    assert report.exit_code == Exit.DATA_PATH_FAILED
    assert "4096 of 4096 B wrong" not in report.detail  # offset 0 holds the pattern's 0 by chance
    assert "B wrong, first at offset 1" in report.detail and report.engine == "tcp-liar"


@pytest.mark.parametrize(("argv", "message"), [
    (["nohost"], "must be 'host:port'"),
    (["127.0.0.1:1", "--layout", "nocolon"], "give MODULE:FUNCTION"),
    (["127.0.0.1:1", "--layout", "probe_layouts:absent"], "has no function 'absent'"),
    (["127.0.0.1:1", "--layout", "probe_layouts:matching", "--bytes", "1GiB"], "at most 16777216"),
    (["127.0.0.1:1", "--layout", "probe_layouts:matching", "--transport", "nosuch"], "unknown"),
])
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    if "--layout" not in argv:
        argv = [*argv, "--layout", "probe_layouts:matching"]
    with pytest.raises(SystemExit) as exited:
        cli.main(["probe", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_prefill_answers_a_bad_echo_with_the_reason_and_stays_up() -> None:
    """What `pdxfer.echo` refuses, said back in EchoDone; the link and the engine carry on."""
    from pdxfer import PrefillEngine, transport
    from pdxfer.pools import PoolSet
    from pdxfer.protocol import MAX_ECHO

    with PrefillEngine(build_pools(8, 4, kv_fields=BIG_KV_FIELDS), EngineConfig(timeout=10.0)) as pre:
        eng = transport.create("tcp")
        try:
            ours = PoolSet(build_pools(8, 4, kv_fields=BIG_KV_FIELDS), eng)
            region = max(ours.regions, key=lambda r: r.length)
            rid = region.descriptor()["region"]
            with socket.create_connection(parse_address(pre.bootstrap_address), TIMEOUT) as sock:
                CONTROL.send(sock, Hello(eng.engine_id, "tcp", eng.address(), **ours.hello_fields()))
                assert isinstance(CONTROL.recv(sock), Welcome)
                for xid, (n, where, ok, error) in enumerate([
                        (0, rid, False, rf"echo of 0 B refused: it must be 1\.\.{MAX_ECHO} B"),
                        (16, 999, False, r"region 999 is not one of the decode's pool regions"),
                        (region.length + 1, rid, False, rf"does not fit the decode's region {rid} "
                                                        rf"\({region.length} B\)"),
                        (16, rid, True, r"^$")], 1):
                    CONTROL.send(sock, Echo(xid, n, where))
                    done = CONTROL.recv(sock)
                    while not isinstance(done, EchoDone):
                        done = CONTROL.recv(sock)  # a Ping on a slow machine
                    assert (done.xid, done.ok) == (xid, ok), done
                    assert re.search(error, done.error), done.error
        finally:
            eng.close()
