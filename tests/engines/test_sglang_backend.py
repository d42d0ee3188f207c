"""pdxfer loaded by SGLang 0.5.23 as `--disaggregation-transfer-backend pdxfer`, driven by SGLang's code.

Prefill runs in its own processes (`sglang_prefill_proc.py`), decode here;
pdxfer moves the bytes between them over tcp on 127.0.0.1. What runs for
real and what is simulated is listed in `sglang_harness`: SGLang's plugin
loading, flag parsing, pools, metadata buffers, KVArgs construction, queues
and poll all-reduce are its own; the scheduler object, the forward pass,
token allocation and the tree cache are simulated.

Five prefill processes, each TP=2 behind its own SGLang bootstrap server:
`mha` (MHA pools), `hybrid` (MHA + Mamba pools), `doomed` (MHA; frozen
and killed by the fence test), `dp2` (two DP ranks under `round_robin`) and
`mla` (MLA pools, replicated over its TP ranks). Every wait is a bounded
poll of SGLang's queues, as its scheduler loop polls them.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from types import SimpleNamespace

import pytest
import sglang_harness as H
import torch
from sglang.srt.disaggregation import base
from sglang.srt.disaggregation import decode as D
from sglang.srt.disaggregation import prefill as P
from sglang.srt.disaggregation import utils as U
from sglang.srt.runtime_context import get_parallel
from sglang_procs import PrefillProc, free_port

from pdxfer import KVPoll
from pdxfer.integrations import sglang as plugin

FIRST_TOKEN = 4242
# The module fixture starts five prefill processes that import SGLang in parallel: 60 s on an
# idle 2-core machine, up to 250 s measured with other suites running; the first test's
# setup carries that.
pytestmark = pytest.mark.timeout(480)


_port = free_port


@pytest.fixture(scope="module")
def procs():
    started = {"mha": PrefillProc(False), "hybrid": PrefillProc(True), "doomed": PrefillProc(False),
               "mla": PrefillProc(mla=True),  # TP 2, both ranks in one process
               # prefill DP 2 under round_robin: each room's DP rank comes from the registry;
               # pdxfer's defaults (liveness 10 s): the request wait is SGLang's (300 s)
               "dp2": PrefillProc(dp=2, config={})}
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
           mla: bool = False, attn_tp: int = 2, **config) -> H.Decode:
    """A decode rank's queues over a pdxfer manager configured by `PDXFER_CONFIG`, built once.

    `attn_tp=1`: the rank of a decode running DP attention (TP 2 as two
    attention-DP ranks of TP 1 each), the DeepSeek-class decode shape.
    """
    if key not in _decodes:
        H.pdxfer_env(**{"timeout": 2.0, **config})
        H.as_rank(rank)
        shape = {} if attn_tp == 2 else dict(attn_tp_size=1, attn_tp_rank=0, attn_dp_size=2,
                                             attn_dp_rank=rank)
        with get_parallel().override(**shape):
            _decodes[key] = H.Decode(server_args, hybrid, dim, mla=mla)
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
    until(lambda: handshake_turn(dec) and (dreq.waiting_for_input or req.finished()),
          "the decode's handshake")
    dec.allocate(dreq, dst, slot)
    return req, dreq


def handshake_turn(dec: H.Decode) -> bool:
    """One turn of SGLang's decode loop over its handshake waiters (always True).

    The prefill's parallel info is looked up in the background and asked for
    at most 0.2 s per turn: a loaded machine's first lookup outlasts one turn,
    and only a later turn (SGLang's loop makes one each iteration) sees it.
    """
    pq = dec.prealloc
    pq._resolve_pending_reqs()  # a request whose prefill's DP rank waited on that lookup
    pq._update_handshake_waiters()
    return True


def finish(dec: H.Decode, req) -> list:
    """Turn `pop_transferred` until the request leaves the transfer queue; the release mocks seen."""
    releases = []

    def turn():
        out, release = dec.transferred()
        releases.append(release)
        # SGLang holds a failed request's pages (deferred release) past its finish
        return (req in out or req.finished()) and not dec.busy()

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


def test_mla_prefill_tp2_to_decode_tp1_reads_one_replica_from_one_rank(server_args, procs) -> None:
    # decode at attention TP 1 (DP attention), prefill at TP 2: the decode rank reads one
    # prefill replica whole; the other prefill rank is expected with nothing to send
    mla, dec = procs["mla"], decode(server_args, "mla-tp1", mla=True, attn_tp=1)
    page_bytes = sum(t[:H.PAGE].nbytes for t in H.buffers(dec.pool))
    for room, dst in ((8000, [40, 41, 42]), (8001, [43, 44, 45])):  # by room: rank 0, then 1
        sender = plugin.replica_rank([0, 1], room)
        assert sender == room % 2
        mla.write(ranks=[0, 1], room=room, n=40, src=[2, 11, 5], ends=[20, 40], token=FIRST_TOKEN,
                  mode="normal")
        req = H.request(room, 40, mla.port)
        dreq = dec.admit(req)
        until(lambda d=dreq: d.waiting_for_input or d.req.finished(), "the decode's handshakes")
        assert dreq.kv_receiver.bootstrap_infos == [a for _, a in dec.prealloc.kv_manager
                                                    .prefill_info_table[f"127.0.0.1:{mla.port}"]
                                                    .ranks[0]]  # both prefill ranks, in order
        dec.allocate(dreq, dst, None)
        finish(dec, req)
        done = {ev["rank"]: ev for ev in (mla.read(), mla.read())}
        assert [done[r]["finished"] for r in (0, 1)] == ["FINISH_LENGTH"] * 2, done
        assert req.finished_reason is None and list(req.output_ids) == [FIRST_TOKEN]
        assert done[0]["crc"] == done[1]["crc"]  # replicated: the same latent cache on each rank
        assert H.page_crc(dec.pool, dst, None) == done[sender]["crc"]  # identical bytes
        # MLA moved once, from one rank: the other shipped nothing (3 pages + the aux row)
        assert done[1 - sender]["nbytes"] == 0, done
        assert done[sender]["nbytes"] > 3 * page_bytes, done


def test_mla_at_equal_tp_pairs_rank_r_with_rank_r(server_args, procs) -> None:
    mla = procs["mla"]
    for rank, room, dst in ((0, 8100, [46, 47, 48]), (1, 8101, [49, 50, 51])):
        dec = decode(server_args, f"mla{rank}", rank, mla=True)
        req, dreq = transfer(dec, mla, room=room, n=40, dst=dst, src=[2, 11, 5], ends=[20, 40],
                             rank=rank)
        assert [rid for rid, _ in dreq.kv_receiver.sources] == [plugin.request_id(room, rank)]
        finish(dec, req)
        done = mla.read()
        assert (done["rank"], done["finished"]) == (rank, "FINISH_LENGTH"), done
        assert H.page_crc(dec.pool, dst, None) == done["crc"]


def test_mixed_tp_for_mha_is_refused_with_the_reason(server_args, procs) -> None:
    dec = decode(server_args, "mha-tp1", attn_tp=1)
    req = H.request(1006, 40, procs["mha"].port)
    dec.admit(req)
    until(lambda: handshake_turn(dec) and req.finished(), "the refusal")
    msg = req.finished_reason.message
    assert "prefill attn_tp_size=2, decode attn_tp_size=1: MHA/GQA K/V is split by head" in msg, msg
    assert "mixed TP works for MLA models" in msg
    assert dec.prealloc.kv_manager.engine.try_poll(plugin.request_id(1006, 0)) is None  # no Expect
    refusal = plugin.mixed_tp_refusal
    assert "multiple of the decode's" in refusal(2, 4, mla=True, states=[])
    assert "multiple of the decode's" in refusal(3, 2, mla=True, states=[])
    assert "['state.mamba'] are split across TP" in refusal(2, 1, mla=True, states=["state.mamba"])
    assert refusal(8, 1, mla=True, states=[]) is None and refusal(2, 2, mla=False, states=[]) is None


def test_a_decode_prefix_hit_ships_only_the_tail(server_args, procs) -> None:
    # SGLang's decode radix cache holds the prompt's first two pages (its own pages 70, 71):
    # the decode allocates the tail only, and the prefill ships only that
    dec, mha = decode(server_args, "mha0"), procs["mha"]
    prefix, tail = [70, 71], [72]
    before = H.page_crc(dec.pool, prefix, None)
    one_page = sum(t[:H.PAGE].nbytes for t in H.buffers(dec.pool))
    req = H.request(1007, 40, mha.port)
    mha.write(rank=0, room=1007, n=40, src=[2, 11, 5], ends=[20, 40], token=FIRST_TOKEN,
              mode="normal")
    dreq = dec.admit(req)
    until(lambda: handshake_turn(dec) and (dreq.waiting_for_input or req.finished()),
          "the decode's handshake")
    dec.allocate(dreq, tail, None, prefix_pages=2)
    finish(dec, req)
    done = mha.read()
    assert done["finished"] == "FINISH_LENGTH" and req.finished_reason is None, done
    assert list(req.output_ids) == [FIRST_TOKEN]
    assert H.page_crc(dec.pool, tail, None) == done["page_crcs"][2]  # the tail's bytes
    assert H.page_crc(dec.pool, prefix, None) == before  # the held prefix pages: untouched
    aux_row = done["nbytes"] - one_page
    assert 0 < aux_row < one_page, done  # one page and the aux row on the wire, not three pages


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
        state = engine.try_poll(plugin.request_id(room, 0))
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


def _admit_all(dec: H.Decode, reqs: list) -> list:
    """SGLang's decode loop until every request is resolved to its prefill rank and handshaken."""
    pq = dec.prealloc
    for req in reqs:
        pq.add(req)

    def resolved() -> bool:
        pq.prefetch_prefill_dp_rank_queries()  # every turn of the decode loop (decode L3133)
        pq._resolve_pending_reqs()
        return not pq.pending_reqs

    until(resolved, "the prefill ranks of every request")
    dreqs = [next(d for d in pq.queue if d.req is req) for req in reqs]

    def handshaken() -> bool:
        pq._update_handshake_waiters()
        return all(d.waiting_for_input or d.req.finished() for d in dreqs)

    until(handshaken, "the handshakes")
    return dreqs


def test_prefill_dp2_under_round_robin_reads_each_room_from_its_dp_rank(server_args, procs) -> None:
    dp2, dec = procs["dp2"], decode(server_args, "mha0")
    for dp, room, dst in ((0, 4001, [50, 51, 52]), (1, 4002, [53, 54, 55])):  # the router's turns
        dp2.write(rank=0, dp=dp, room=room, n=40, src=[2, 11, 5], slot=None, ends=[20, 40],
                  token=FIRST_TOKEN, mode="normal")
        req = H.request(room, 40, dp2.port)
        (dreq,) = _admit_all(dec, [req])
        assert dec.prealloc.kv_manager.prefill_info_table[f"127.0.0.1:{dp2.port}"].dp_size == 2
        dec.allocate(dreq, dst, None)
        finish(dec, req)
        done = dp2.read()
        assert (done["room"], done["finished"]) == (room, "FINISH_LENGTH"), done
        assert req.finished_reason is None
        assert H.page_crc(dec.pool, dst, None) == done["crc"]  # DP rank `dp`'s bytes (own seed)


def test_a_queue_of_64_rooms_waiting_past_10s_for_allocation_completes(server_args, procs) -> None:
    # both sides at pdxfer's default liveness timeout (10 s): the bound this test outwaits
    queue, dec = procs["dp2"], decode(server_args, "queue0", timeout=10.0)
    rooms = list(range(5000, 5064))
    queue.write(batch=[dict(rank=0, dp=0, room=room, n=H.PAGE, src=[i % 90], token=FIRST_TOKEN)
                       for i, room in enumerate(rooms)])
    reqs = [H.request(room, H.PAGE, queue.port) for room in rooms]
    dreqs = _admit_all(dec, reqs)
    # The decode's allocation waits behind memory pressure (a stated delay: 11 s, past
    # pdxfer's former request wait, its 10 s liveness timeout); SGLang's loop keeps turning.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 11.0:
        dec.prealloc._update_handshake_waiters()
        assert not any(d.req.finished() for d in dreqs)
        time.sleep(0.05)
    dst = list(range(30, 30 + len(rooms)))
    for dreq, page in zip(dreqs, dst, strict=True):
        dec.allocate(dreq, [page], None)

    def all_done() -> bool:
        out, _ = dec.transferred()
        return all(r.finished() or r in out or not any(d.req is r for d in dec.transfer.queue)
                   for r in reqs) and not dec.busy()

    until(all_done, "64 rooms to finish", deadline_s=120.0)
    done = {d["room"]: d for d in queue.read()["batch_done"]}
    assert [r.finished_reason for r in reqs] == [None] * len(rooms)
    for room, page in zip(rooms, dst, strict=True):
        assert done[room]["finished"] == "FINISH_LENGTH", done[room]
        assert H.page_crc(dec.pool, [page], None) == done[room]["crc"]


def test_request_waits_default_to_sglangs_settings(server_args, monkeypatch) -> None:
    dec = decode(server_args, "mha0")
    cfg = dec.prealloc.kv_manager.config
    # the decode waits for its transfer as long as SGLang's WAITING_TIMEOUT; liveness stays short
    assert (cfg.request_wait, cfg.timeout) == (300.0, 2.0)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "900")
    H.pdxfer_env(timeout=2.0)
    H.as_rank(0)
    mgr = plugin.PdxferKVManager(dec.prealloc.kv_manager.kv_args, "decode", server_args)
    try:
        assert mgr.config.request_wait == 900.0
    finally:
        mgr.close()
    H.pdxfer_env(timeout=2.0, request_timeout=5.0)  # PDXFER_CONFIG still wins
    mgr = plugin.PdxferKVManager(dec.prealloc.kv_manager.kv_args, "decode", server_args)
    try:
        assert mgr.config.request_wait == 5.0
    finally:
        mgr.close()


def test_prefill_ranks_register_where_the_bootstrap_server_runs_not_on_their_own_host(
        server_args) -> None:
    # node 0 (127.0.0.2) runs SGLang's bootstrap server; the rank's own --host is 127.0.0.3, its
    # --dist-init-addr node 0's: it must register on 127.0.0.2, as SGLang's managers do
    port = free_port("127.0.0.2")
    plugin.PdxferKVBootstrapServer("127.0.0.2", port)
    node1 = PrefillProc(port=port, flags=(  # both TP ranks: the registry waits for every one
        "--host", "127.0.0.3", "--dist-init-addr", f"127.0.0.2:{free_port('127.0.0.2')}"))
    try:
        assert node1.read() == {"ready": True}
        dec = decode(server_args, "mha0")
        node1.write(rank=0, room=6001, n=40, src=[2, 11, 5], slot=None, ends=[40],
                    token=FIRST_TOKEN, mode="normal")
        req = H.request(6001, 40, port, host="127.0.0.2")
        (dreq,) = _admit_all(dec, [req])
        dec.allocate(dreq, [60, 61, 62], None)
        finish(dec, req)
        done = node1.read()
        assert done["finished"] == "FINISH_LENGTH" and req.finished_reason is None
        assert H.page_crc(dec.pool, [60, 61, 62], None) == done["crc"]
    finally:
        node1.close()


def test_unsupported_hybrid_states_are_refused_by_name(server_args) -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    args = SimpleNamespace(state_types=[StateType.MAMBA, StateType.SWA, StateType.BLOCK_SCALE],
                           page_size=H.PAGE)
    with pytest.raises(plugin.ConfigError, match=r"\['swa', 'block_scale'\] \(SGLang StateType\)"):
        plugin.PdxferKVManager(args, "decode", server_args)
    assert plugin.unsupported_states([StateType.MAMBA]) is None


def test_decode_tp2_without_deferred_release_is_refused(server_args, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    args = SimpleNamespace(state_types=[], page_size=H.PAGE)
    with pytest.raises(plugin.ConfigError, match="attn_tp_size=2.*needs SGLang's deferred decode KV"):
        plugin.PdxferKVManager(args, "decode", server_args)


def test_release_memory_occupation_of_moving_pools_is_refused(server_args) -> None:
    dec = decode(server_args, "mha0")
    dec.prealloc.release_memory_occupation()  # no memory saver: the pools stay put, a no-op
    dec.prealloc.resume_memory_occupation()
    mgr = dec.prealloc.kv_manager
    saved = mgr.server_args
    mgr.server_args = SimpleNamespace(enable_memory_saver=True)
    try:
        with pytest.raises(plugin.ConfigError, match="--enable-memory-saver would move the KV pools"):
            dec.prealloc.release_memory_occupation()
    finally:
        mgr.server_args = saved


def test_the_early_send_event_orders_the_chunk_it_belongs_to() -> None:
    sent = []
    engine = SimpleNamespace(send=lambda rid, idx, **kw: sent.append(kw), try_poll=lambda rid: None)
    mgr = SimpleNamespace(mode="prefill", engine=engine, register_room=lambda room: None, attn_tp_rank=0,
                          indices=lambda kv, aux, st: {"kv": kv})
    sender = plugin.PdxferKVSender(mgr, "127.0.0.1:1", 9, req_has_disagg_prefill_dp_rank=True)
    sender.init(3, aux_index=0)
    event = object()  # SGLang's torch.cuda.Event on the forward stream (overlap scheduling)
    sender._early_send_wait_event = event
    sender.send([1])
    sender.send([2], indices_event="indices")
    sender.send([3], state_indices=[])
    assert sent == [{"last": False, "ready": event}, {"last": False, "ready": "indices"},
                    {"last": True}]


def test_managers_close(server_args) -> None:
    for dec in _decodes.values():
        dec.prealloc.kv_manager.close()
        dec.prealloc.kv_manager.close()  # idempotent
    torch.distributed.destroy_process_group()
