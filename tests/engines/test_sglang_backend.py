"""pdxfer loaded by SGLang 0.5.23 as `--disaggregation-transfer-backend pdxfer`, driven by SGLang's code.

Prefill runs in its own processes (`sglang_prefill_proc.py`), decode here;
pdxfer moves the bytes between them over tcp on 127.0.0.1. What runs for
real and what is simulated is listed in `sglang_harness`: SGLang's plugin
loading, flag parsing, pools, metadata buffers, KVArgs construction, queues
and poll all-reduce are its own; the scheduler object, the forward pass,
token allocation and the tree cache are simulated.

Three prefill processes, each TP=2 behind its own SGLang bootstrap server:
`mha` (MHA pools), `hybrid` (MHA + Mamba pools) and `doomed` (MHA; frozen
and killed by the fence test). Every wait is a bounded poll of SGLang's
queues, as its scheduler loop polls them.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang_harness as H
import torch
from sglang.srt.disaggregation import base
from sglang.srt.disaggregation import decode as D
from sglang.srt.disaggregation import prefill as P
from sglang.srt.disaggregation import utils as U

from pdxfer import KVPoll
from pdxfer.integrations import sglang as plugin

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIRST_TOKEN = 4242


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefillProc:
    """One prefill process, stepped line by line."""

    def __init__(self, hybrid: bool) -> None:
        self.port = _port()
        # Not ROOT: a checkout's stale pdxfer.egg-info there would hide the installed entry points.
        env = {**os.environ, "PYTHONPATH": str(HERE),
               "PDXFER_CONFIG": json.dumps({"transport": "tcp", "host": "127.0.0.1",
                                            "timeout": 2.0, "request_timeout": 30.0})}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sglang_prefill_proc.py"),
                                      str(self.port), "1" if hybrid else "0", "2"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env)

    def read(self) -> dict:
        while True:  # SGLang logs to stdout too: our events are the JSON lines
            line = self.proc.stdout.readline()
            assert line, f"prefill process exited ({self.proc.wait(30)})"
            if line.startswith("{"):
                return json.loads(line)

    def write(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) if cmd else "go") + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def procs():
    started = {"mha": PrefillProc(False), "hybrid": PrefillProc(True), "doomed": PrefillProc(False)}
    try:
        for p in started.values():
            assert p.read() == {"ready": True}
        yield started
    finally:
        for p in started.values():
            p.close()


@pytest.fixture(scope="module")
def server_args():
    return H.start("decode", _port(), tp=2)


_decodes: dict = {}


def decode(server_args, key: str, rank: int = 0, hybrid: bool = False, dim: int = H.DIM,
           **config) -> H.Decode:
    """A decode rank's queues over a pdxfer manager configured by `PDXFER_CONFIG`, built once."""
    if key not in _decodes:
        H.pdxfer_env(**{"timeout": 2.0, **config})
        H.as_rank(rank)
        _decodes[key] = H.Decode(server_args, hybrid, dim)
    H.as_rank(rank)
    return _decodes[key]


def until(fn, what: str, deadline_s: float = 30.0):
    deadline = time.monotonic() + deadline_s
    while not (out := fn()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)
    return out


def transfer(dec: H.Decode, proc: PrefillProc, *, room: int, n: int, dst: list[int],
             src: list[int], ends: list[int], rank: int = 0, slot: int | None = None,
             src_slot: int | None = None, mode: str = "normal"):
    """Admit on decode, let the prefill run `mode`, return the decode's request once finished."""
    req = H.request(room, n, proc.port)
    proc.write(rank=rank, room=room, n=n, src=src, slot=src_slot, ends=ends, token=FIRST_TOKEN,
               mode=mode)
    dreq = dec.admit(req)
    until(lambda: dreq.waiting_for_input or req.finished(), "the decode's handshake")
    dec.allocate(dreq, dst, slot)
    return req, dreq


def finish(dec: H.Decode, req) -> list:
    """Turn `pop_transferred` until the request leaves the transfer queue; the release mocks seen."""
    releases = []

    def turn():
        out, release = dec.transferred()
        releases.append(release)
        return req in out or req.finished()

    until(turn, f"request {req.rid} to finish on decode")
    return releases


# -- plugin loading and dispatch -------------------------------------------------------
def test_the_flag_resolves_to_pdxfer_through_the_entry_point(server_args) -> None:
    from importlib.metadata import entry_points

    eps = entry_points(group="sglang.srt.plugins")
    assert [e.value for e in eps if e.name == "pdxfer"] == ["pdxfer.integrations.sglang:register"]
    assert server_args.disaggregation_transfer_backend == "pdxfer"  # prepare_server_args took it
    backend = U.TransferBackend("pdxfer")
    assert P.TransferBackend is U.TransferBackend and D.TransferBackend is U.TransferBackend
    kinds = {"MANAGER": plugin.PdxferKVManager, "SENDER": plugin.PdxferKVSender,
             "RECEIVER": plugin.PdxferKVReceiver, "BOOTSTRAP_SERVER": plugin.PdxferKVBootstrapServer}
    for kind, cls in kinds.items():
        assert P.get_kv_class(backend, getattr(U.KVClassType, kind)) is cls
        assert D.get_kv_class(backend, getattr(U.KVClassType, kind)) is cls
    assert P.get_kv_class(backend, U.KVClassType.KVARGS) is base.KVArgs
    # the other backends still resolve to SGLang's own classes
    assert P.get_kv_class(U.TransferBackend("fake"), U.KVClassType.SENDER).__module__.endswith("fake.conn")


def test_drift_guard_pdxfer_implements_every_base_method_with_its_signature() -> None:
    pairs = [(base.BaseKVManager, plugin.PdxferKVManager), (base.BaseKVSender, plugin.PdxferKVSender),
             (base.BaseKVReceiver, plugin.PdxferKVReceiver),
             (base.BaseKVBootstrapServer, plugin.PdxferKVBootstrapServer)]
    for ours_base, ours in pairs:
        assert not getattr(ours, "__abstractmethods__", None), f"{ours.__name__} left abstract"
        for name, fn in vars(ours_base).items():
            if not callable(fn) or (name.startswith("_") and name != "__init__"):
                continue
            theirs = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            mine = inspect.signature(getattr(ours, name)).parameters
            for p in theirs:  # every parameter SGLang may pass, by name and kind
                assert p.name in mine, f"{ours.__name__}.{name} lacks {p.name!r} (SGLang: {theirs})"
                if p.default is not p.empty:
                    assert mine[p.name].default is not p.empty, f"{ours.__name__}.{name}({p.name})"
    # the de-facto decode API the queues call beyond the ABC
    assert callable(plugin.PdxferKVManager.try_ensure_parallel_info)
    receiver = plugin.PdxferKVReceiver(SimpleNamespace(mode="decode"), "127.0.0.1:1", 5)
    assert (receiver.conclude_state, receiver.abort_notified, receiver.require_staging) == (
        None, False, False)


# -- transfers -------------------------------------------------------------------------
def test_chunked_mha_on_both_tp_ranks_holds_back_the_partial_page(server_args, procs) -> None:
    mha = procs["mha"]
    dst, src = [7, 3, 9], [2, 11, 5]
    for rank, room in ((0, 1001), (1, 1002)):
        dec = decode(server_args, f"mha{rank}", rank)
        req, dreq = transfer(dec, mha, room=room, n=40, dst=dst, src=src, ends=[20, 40], rank=rank,
                             mode="step")
        one_page = sum(t[:H.PAGE].nbytes for t in H.buffers(dec.pool))
        # 20 tokens computed: SGLang sent the one whole page and held back the partial one
        assert mha.read() == {"room": room, "phase": "sent-first", "nbytes": one_page}
        mha.write()
        finish(dec, req)
        done = mha.read()
        assert (done["room"], done["finished"]) == (room, "FINISH_LENGTH")
        assert req.finished_reason is None and list(req.output_ids) == [FIRST_TOKEN]  # via the aux row
        assert H.page_crc(dec.pool, dst, None) == done["crc"]  # rank r's bytes, from prefill rank r


def test_chunked_hybrid_ships_the_mamba_slot_and_the_first_token(server_args, procs) -> None:
    dec = decode(server_args, "hybrid0", hybrid=True)
    before_other = H.page_crc(dec.pool, [0], 4)
    req, _ = transfer(dec, procs["hybrid"], room=2001, n=40, dst=[7, 3, 9], src=[2, 11, 5],
                      ends=[20, 40], slot=5, src_slot=2)
    finish(dec, req)
    done = procs["hybrid"].read()
    assert done["finished"] == "FINISH_LENGTH" and list(req.output_ids) == [FIRST_TOKEN]
    assert H.page_crc(dec.pool, [7, 3, 9], 5) == done["crc"]
    assert H.page_crc(dec.pool, [0], 4) == before_other  # another slot untouched


def test_a_zero_page_last_chunk_still_ships_aux_and_state(server_args, procs) -> None:
    dec = decode(server_args, "hybrid0", hybrid=True)
    # 32 tokens = 2 whole pages, all sent by the first chunk; the last chunk has no page
    req, _ = transfer(dec, procs["hybrid"], room=2002, n=32, dst=[12, 13], src=[20, 21],
                      ends=[32, 32], slot=6, src_slot=3)
    finish(dec, req)
    done = procs["hybrid"].read()
    assert done["finished"] == "FINISH_LENGTH" and list(req.output_ids) == [FIRST_TOKEN]
    assert H.page_crc(dec.pool, [12, 13], 6) == done["crc"]


def test_decode_abort_before_send_fails_both_sides_and_writes_nothing(server_args, procs) -> None:
    dec, mha = decode(server_args, "mha0"), procs["mha"]
    before = H.page_crc(dec.pool, [20, 21, 22], None)
    req, dreq = transfer(dec, mha, room=1003, n=40, dst=[20, 21, 22], src=[2, 11, 5],
                         ends=[20, 40], mode="hold")
    assert mha.read() == {"room": 1003, "phase": "bootstrapped"}
    dreq.kv_receiver.abort()
    releases = finish(dec, req)
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert "aborted by decode" in req.finished_reason.message
    assert sum(r.call_count for r in releases) == 1  # the pages went back once, after Failed
    mha.write()  # the prefill's forward ran anyway; its chunks are dropped
    done = mha.read()
    assert done["finished"] == "FINISH_ABORT" and "aborted by decode" in done["message"]
    assert H.page_crc(dec.pool, [20, 21, 22], None) == before


def test_a_layout_mismatch_fails_the_request_with_pdxfers_reason(server_args, procs) -> None:
    dec = decode(server_args, "wide0", dim=2 * H.DIM)  # head_dim 64 against the prefill's 32
    req = H.request(1004, 40, procs["mha"].port)
    dreq = dec.admit(req)
    dec.allocate(dreq, [1, 2, 3], None)
    releases = finish(dec, req)
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    msg = req.finished_reason.message
    assert "layout mismatch" in msg and "pool 'kv'" in msg and "[16, 128] vs [16, 256]" in msg, msg
    assert sum(r.call_count for r in releases) == 1


def test_a_corrupted_aux_row_is_caught_by_sglangs_check(server_args, procs) -> None:
    dec, mha = decode(server_args, "mha0"), procs["mha"]
    req, _ = transfer(dec, mha, room=1005, n=40, dst=[30, 31, 4], src=[2, 11, 5], ends=[40],
                      mode="corrupt")
    finish(dec, req)
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert "corruption" in req.finished_reason.message.lower()
    assert mha.read()["finished"] == "FINISH_LENGTH"  # the prefill side saw a clean transfer


def test_prefill_death_without_a_fence_never_reads_failed_before_it_is_safe(server_args, procs) -> None:
    # tcp with fence=False: what a one-sided transport that cannot fence does (#11)
    dec = decode(server_args, "nofence0", transport_options={"fence": False}, timeout=1.0)
    doomed, room = procs["doomed"], 3001
    req, dreq = transfer(dec, doomed, room=room, n=40, dst=[24, 25, 26], src=[2, 11, 5],
                         ends=[20, 40], mode="die")
    event = doomed.read()
    assert event.get("phase") == "sent-first", (event, req.finished_reason)
    engine, receiver = dec.prealloc.kv_manager.engine, dreq.kv_receiver
    seen = []
    poll = receiver.poll

    def watched():
        state = engine.try_poll(str(room))
        out = poll()
        seen.append((state, out))
        return out

    receiver.poll = watched
    os.kill(doomed.proc.pid, signal.SIGSTOP)  # frozen: its sockets stay open, nothing acks
    try:
        releases = []

        def quarantined_a_while() -> bool:
            out, release = dec.transferred()
            releases.append(release)
            assert not out and not req.finished()
            return sum(s is KVPoll.Quarantined for s, _ in seen) >= 20

        until(quarantined_a_while, "the request to sit quarantined")
        assert all(r.call_count == 0 for r in releases)  # SGLang still holds the pages
    finally:
        os.kill(doomed.proc.pid, signal.SIGKILL)  # the kernel closes its sockets: safe now
    releases = finish(dec, req)
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert sum(r.call_count for r in releases) == 1
    # SGLang saw Transferring while pdxfer held the request, Failed only once it was safe
    assert all(out == KVPoll.Transferring for state, out in seen if state is KVPoll.Quarantined)
    assert seen[-1][1] == KVPoll.Failed and seen[-1][0] in (KVPoll.Failed, None)
    assert not any(out == KVPoll.Failed for state, out in seen if state is KVPoll.Quarantined)


def test_managers_close(server_args) -> None:
    for dec in _decodes.values():
        dec.prealloc.kv_manager.close()
        dec.prealloc.kv_manager.close()  # idempotent
    torch.distributed.destroy_process_group()
