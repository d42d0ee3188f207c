"""pdxfer's vLLM connector as people deploy it (#31): the plugin edge, aborts, load failures,
serving timeouts, identity, metrics, a local prefix hit, many requests in flight.

vLLM's real scheduler in both roles, each engine's worker-side connector in processes of its
own (one per TP rank), as tests/engines/vllm_harness.py sets them up.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.utils import (
    KVOutputAggregator,
    get_kv_connector_cache_layout,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import (
    BLOCK,
    HEAD,
    HEADS,
    Engine,
    WorkerDied,
    block_bytes,
    die_mid_transfer,
    logged,
    prefill,
    request,
    send_state,
    until,
    waits,
    write_model,
)

from pdxfer.config import KVPoll
from pdxfer.errors import ConfigError
from pdxfer.integrations import vllm as connector_module
from pdxfer.integrations.vllm import PdxferConnector, PdxferKVConnectorStats

# Generous: every test runs several engines' worker processes, and must pass on two busy cores.
pytestmark = pytest.mark.timeout(600)

BLOCK_BYTES = 2 * 2 * BLOCK * HEADS * HEAD * 2  # both layers' K and V of one block, fp16
# a decode request whose KV loaded: running, or already done with its two tokens
LOADED = (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module", autouse=True)
def plugin_runs(tmp_path_factory):
    """The plugin-edge scripts (item 7), started as the module's first test starts.

    Each is a fresh interpreter importing vLLM (seconds of one core); started here, they run
    beside the engine tests, which mostly wait on their workers, and the module's last two
    tests read what they printed.
    """
    runs = _runs(tmp_path_factory.mktemp("plugin"))
    yield runs
    for proc, out, err in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        out.close()
        err.close()


def merged(side: Engine) -> PdxferKVConnectorStats:
    """Everything the side's scheduler handed its loggers, as vLLM's logger rebuilds it."""
    total = PdxferConnector.build_kv_connector_stats()
    for data in side.stats:
        total.aggregate(PdxferConnector.build_kv_connector_stats(data))
    return total


# -- item 2: aborts ------------------------------------------------------------------------------
def test_an_abort_while_loading_reaches_the_prefill_within_a_second(model_dir) -> None:
    # Long request waits: without the abort being passed on, nothing would end this for a minute.
    P = Engine(model_dir, "kv_producer", seed=21, request_timeout=60.0)
    D = Engine(model_dir, "kv_consumer", seed=22, request_timeout=60.0)
    try:
        free_p, free_d = P.free_blocks(), D.free_blocks()
        params, _ = prefill(P, "r21", 40)  # finished: P's next step issues the send
        dreq = request("d21", 40, dict(params), 4)
        D.sched.add_request(dreq)
        D.step()  # allocated, the Expect on its way to P
        assert dreq.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = list(D.sched.kv_cache_manager.get_block_ids("d21")[0])
        before = block_bytes(D, "layer.0", d_blocks)
        # P's engine holds the Expect: a send issued now would write into the decode's blocks
        until(lambda: P.call(send_state, "r21") is not None, "the prefill to hold d21's Expect")

        started = time.monotonic()
        D.sched.finish_requests("d21", RequestStatus.FINISHED_ABORTED)  # the client went away
        D.step()  # finished_req_ids reaches the worker, which aborts in pdxfer
        until(lambda: P.call(send_state, "r21") is KVPoll.Failed, "the prefill to hear of the abort",
              deadline_s=5.0)
        heard = time.monotonic() - started

        def both_freed() -> bool:
            P.step()
            D.step()
            return P.free_blocks() == free_p and D.free_blocks() == free_d

        until(both_freed, "both sides to free the aborted request's blocks", deadline_s=5.0)
        took = time.monotonic() - started
        assert heard < 1.0 and took < 1.0, f"the prefill heard in {heard:.2f} s, freed in {took:.2f} s"
        assert not P.sched.connector.has_pending_push_work()
        after = block_bytes(D, "layer.0", d_blocks)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing landed
        assert merged(D).data["failed"] == ["aborted"]  # counted by its cause
        assert merged(P).data["failed"] and merged(P).data["bytes"] == []
    finally:
        P.close()
        D.close()


# -- item 3: load failures -----------------------------------------------------------------------
SYSTEM = list(range(500, 532))  # a 32-token system prompt: two whole blocks every request shares


def test_a_prefill_dying_mid_transfer_recomputes_exactly_the_blocks_it_did_not_deliver(model_dir) -> None:
    # D holds the shared system prompt in its prefix cache; d-bad loads only its third block, from
    # P2, which dies halfway through writing it; d-ok loads from P1 meanwhile.
    P1 = Engine(model_dir, "kv_producer", seed=23, request_timeout=60.0)
    P2 = Engine(model_dir, "kv_producer", seed=24, request_timeout=60.0)
    D = Engine(model_dir, "kv_consumer", seed=25, policy="recompute", timeout=2.0,
               request_timeout=60.0, prefix_caching=True)
    try:
        warm_params, _ = prefill(P1, "warm", 40, tokens=SYSTEM + list(range(8)))
        warm = request("d-warm", 40, dict(warm_params), 100, tokens=SYSTEM + list(range(8)))
        D.sched.add_request(warm)
        until(lambda: (P1.step(), D.step()) and warm.status is RequestStatus.RUNNING, "the warm-up")
        warm_blocks = list(D.sched.kv_cache_manager.get_block_ids("d-warm")[0])
        D.sched.finish_requests("d-warm", RequestStatus.FINISHED_ABORTED)  # its blocks: cached
        ok_params, (ok_src,) = prefill(P1, "ok", 40, first=300)
        bad_tokens = SYSTEM + list(range(100, 108))
        bad_params, (bad_src,) = prefill(P2, "bad", 40, tokens=bad_tokens)
        sent = [t for layer in ("layer.0", "layer.1") for t in block_bytes(P2, layer, bad_src[2:])]
        P2.call(die_mid_transfer)
        d_ok = request("d-ok", 40, dict(ok_params), 4, first=300)
        d_bad = request("d-bad", 40, dict(bad_params), 4, tokens=bad_tokens)
        D.sched.add_request(d_ok)
        D.sched.add_request(d_bad)
        D.step()
        assert d_ok.status is d_bad.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        ok_blocks = list(D.sched.kv_cache_manager.get_block_ids("d-ok")[0])
        bad_blocks = list(D.sched.kv_cache_manager.get_block_ids("d-bad")[0])
        assert bad_blocks[:2] == warm_blocks[:2]  # the system prompt's two blocks: a local hit
        tail = bad_blocks[2:]
        until(lambda: P2.call(send_state, "bad") is not None, "P2 to hold d-bad's Expect")

        def p2_gone() -> bool:
            try:
                P2.step()  # issues the send: half of it is written, then the process is killed
            except WorkerDied:
                return True
            return not all(p.is_alive() for p in P2.procs)

        until(p2_gone, "P2 to die in the transfer")
        recomputed: dict[str, int] = {}

        def settled() -> bool:
            P1.step()
            so, _ = D.step()
            if "d-bad" in so.num_scheduled_tokens:
                recomputed.setdefault("d-bad", so.num_scheduled_tokens["d-bad"])
            return d_ok.status in LOADED and "d-bad" in recomputed

        until(settled, "d-ok to load and d-bad to be recomputed")
        # the prefill died mid-transfer: of the tail block's four tensors (K and V of two layers)
        # some landed before it died and some never came
        got = [t for layer in ("layer.0", "layer.1") for t in block_bytes(D, layer, tail)]
        landed = [torch.equal(a, b) for a, b in zip(sent, got, strict=True)]
        assert any(landed) and not all(landed), landed
        # vLLM was told exactly the blocks that did not arrive whole: d-bad's tail, not its
        # cached prefix (shared with d-warm) and not d-ok's
        assert D.invalid == [set(tail)]
        assert recomputed["d-bad"] == 8  # the recompute policy redid the tail block's 8 tokens
        assert d_bad.status in LOADED  # recomputed, not failed
        want = block_bytes(P1, "layer.1", ok_src)
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(D, "layer.1", ok_blocks),
                                                     strict=True))
        assert len(merged(D).data["failed"]) == 1 and merged(D).data["failed"][0] != "aborted"
    finally:
        P1.close()
        P2.close()
        D.close()


# -- item 4: timeouts ----------------------------------------------------------------------------
def test_the_request_wait_is_serving_sized_unless_set_and_the_liveness_bound_stays_short(model_dir) -> None:
    by_default = Engine(model_dir, "kv_consumer", timeout=3.0, request_timeout=None)
    chosen = Engine(model_dir, "kv_consumer", timeout=3.0, request_timeout=7.0)
    try:
        # a dead peer still fails in seconds, a queued request waits minutes
        assert by_default.call(waits) == (connector_module.SERVING_REQUEST_TIMEOUT, 3.0)
        assert connector_module.SERVING_REQUEST_TIMEOUT == 300.0
        assert chosen.call(waits) == (7.0, 3.0)
    finally:
        by_default.close()
        chosen.close()


def test_a_request_queued_on_the_decode_past_the_prefills_wait_is_kept_alive(model_dir) -> None:
    wait = 3.0  # both sides' request wait: the decode renews every wait / 3
    P = Engine(model_dir, "kv_producer", seed=36, request_timeout=wait)
    D = Engine(model_dir, "kv_consumer", seed=37, request_timeout=wait, max_seqs=1)
    try:
        params, (src,) = prefill(P, "r36", 40)
        blocker = request("local", 8, {}, 500, first=900)  # a local request in D's one slot
        D.sched.add_request(blocker)
        dreq = request("d36", 40, dict(params), 4)
        D.sched.add_request(dreq)
        D.step()  # the blocker runs; d36 queued, its hold handed to the worker
        assert dreq.status is RequestStatus.WAITING
        started = time.monotonic()
        # three request waits pass with d36 queued (D not even stepped): without the renewals
        # the prefill's send would fail after one, and the Expect would find it released
        until(lambda: P.step() and time.monotonic() - started > 3 * wait, "three request waits",
              deadline_s=60.0)
        held = P.call(send_state, "r36")
        assert held is not None and not held.finished, held  # the send still waits for d36
        D.sched.finish_requests("local", RequestStatus.FINISHED_ABORTED)
        until(lambda: (P.step(), D.step()) and dreq.status in LOADED
              and "r36" not in P.sched.requests, "d36 to load after its wait")
        want = block_bytes(P, "layer.1", src)
        got = block_bytes(D, "layer.1", list(D.sched.kv_cache_manager.get_block_ids("d36")[0]))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        P.close()
        D.close()


# -- items 6 and 8: metrics, identity ------------------------------------------------------------
def _prom(cfg) -> tuple[CollectorRegistry, object]:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    return reg, PdxferConnector.build_prom_metrics(cfg, types, ["model_name", "engine"],
                                                   {0: ["m", "0"]})


def test_the_stats_and_prometheus_series_read_back_what_was_moved(model_dir) -> None:
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    P, D = Engine(model_dir, "kv_producer", seed=26), Engine(model_dir, "kv_consumer", seed=27)
    try:
        params, _ = prefill(P, "r26", 40)
        dreq = request("d26", 40, dict(params), 4)
        D.sched.add_request(dreq)
        until(lambda: (P.step(), D.step()) and dreq.status in LOADED
              and "r26" not in P.sched.requests, "the transfer")
        sent, got = merged(P), merged(D)
        for s in (sent, got):  # vLLM's scheduler carried them to its loggers, both roles alike
            assert s.data["bytes"] == [3 * BLOCK_BYTES] and s.data["failed"] == []
            assert len(s.data["transfer_s"]) == 1 and 0 < s.data["transfer_s"][0] < 30
        assert sent.data["segments"] == got.data["segments"] and sent.data["segments"][0] > 0
        # the prefill's wire time (first write posted to last complete) within its elapsed time
        assert len(sent.data["wire_s"]) == 1 and 0 < sent.data["wire_s"][0] <= sent.data["transfer_s"][0]
        line = got.reduce()
        assert line["Num successful transfers"] == 1 and line["Num failed transfers"] == 0
        assert line["Avg MB per transfer"] == round(3 * BLOCK_BYTES / 2**20, 3)

        # vLLM's own Prometheus logger, fed the SchedulerStats the decode's scheduler produced
        prom = PrometheusStatLogger(D.cfg)
        for stats in D.side.scheduler_stats:
            prom.record(scheduler_stats=stats, iteration_stats=None)
        labels = {"model_name": D.cfg.model_config.served_model_name, "engine": "0"}

        def sample(name: str) -> float | None:
            return REGISTRY.get_sample_value(name, labels)

        assert sample("vllm:pdxfer_bytes_transferred_sum") == 3 * BLOCK_BYTES
        assert sample("vllm:pdxfer_bytes_transferred_count") == 1
        assert sample("vllm:pdxfer_transfer_time_seconds_sum") == pytest.approx(got.data["transfer_s"][0])
        assert sample("vllm:pdxfer_num_segments_sum") == got.data["segments"][0]
        assert sample("vllm:pdxfer_quarantine_seconds_count") == 0
        prom_p = PrometheusStatLogger(P.cfg)  # the prefill's, on its own (fresh) registry entries
        for stats in P.side.scheduler_stats:
            prom_p.record(scheduler_stats=stats, iteration_stats=None)
        p_labels = {"model_name": P.cfg.model_config.served_model_name, "engine": "0"}
        assert REGISTRY.get_sample_value("vllm:pdxfer_wire_time_seconds_sum", p_labels) == pytest.approx(
            sent.data["wire_s"][0])
        assert REGISTRY.get_sample_value("vllm:pdxfer_bytes_transferred_sum", p_labels) == 3 * BLOCK_BYTES
        # vLLM's log line: its logger folds the interval's stats and prints our reduce()
        logger = LoggingStatLogger(D.cfg)
        for stats in D.side.scheduler_stats:
            logger.record(scheduler_stats=stats, iteration_stats=None)
        lines: list[str] = []
        logger.kv_connector_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1 and "Num successful transfers=1," in lines[0], lines
        assert f"Avg MB per transfer={round(3 * BLOCK_BYTES / 2**20, 3)}," in lines[0]

        # TP 2: vLLM's own aggregator folds the two workers' stats into one (a transfer per rank)
        outs = []
        for i in range(2):
            o = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                  logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
            o.kv_connector_output = KVConnectorOutput(kv_connector_stats=PdxferKVConnectorStats(
                {"bytes": [100 * (i + 1)], "segments": [1], "transfer_s": [0.5],
                 "failed": ["PeerLostError"] * i}))
            outs.append(o)
        agg = KVOutputAggregator(2).aggregate(outs).kv_connector_output.kv_connector_stats
        assert agg.data["bytes"] == [100, 200] and agg.reduce()["Failed (PeerLostError)"] == 1
    finally:
        P.close()
        D.close()


def test_engines_serving_different_models_are_refused_by_name(model_dir, tmp_path) -> None:
    other = write_model(tmp_path / "another-model")  # same shapes: only the identity tells
    assert PdxferConnector.get_required_kvcache_layout(None) is None
    P = Engine(model_dir, "kv_producer", seed=28, timeout=1.0, request_timeout=1.0)
    D = Engine(other, "kv_consumer", seed=29)
    try:
        assert get_kv_connector_cache_layout(D.cfg) == "LBNHC"  # what vLLM asks its backends for
        params, _ = prefill(P, "r28", 40)
        everything = list(range(D.side.blocks))
        before = block_bytes(D, "layer.0", everything)
        dreq = request("d28", 40, dict(params), 4)
        D.sched.add_request(dreq)
        until(lambda: D.step() and dreq.is_finished(), "the decode request to be refused")
        assert dreq.status is RequestStatus.FINISHED_ERROR
        after = block_bytes(D, "layer.0", everything)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # not a byte
        refusal = [m for m in D.call(logged) if "transfer of d28 failed" in m]
        assert len(refusal) == 1 and "layout mismatch" in refusal[0]
        assert f"model={model_dir} " in refusal[0] and f"model={other} " in refusal[0]
        assert merged(D).data["failed"] == ["LayoutMismatchError"]
        reg, prom = _prom(D.cfg)
        prom.observe(merged(D).data, 0)
        assert reg.get_sample_value("vllm:pdxfer_num_failed_transfers_total", {
            "model_name": "m", "engine": "0", "reason": "LayoutMismatchError"}) == 1
    finally:
        P.close()
        D.close()


# -- item 1: a local prefix hit on the decode loads only the uncached tail ------------------------
def test_shared_prefix_requests_ship_only_the_tail_and_free_the_prefill_at_once(model_dir, caplog) -> None:
    # Long waits: a prefill send the decode never expected would hold its blocks for a minute.
    P = Engine(model_dir, "kv_producer", seed=30, request_timeout=60.0, prefix_caching=True)
    D = Engine(model_dir, "kv_consumer", seed=31, request_timeout=60.0, prefix_caching=True)
    try:
        free_p = P.free_blocks()
        prompts = {"a": SYSTEM + list(range(8)), "b": SYSTEM + list(range(50, 58))}
        src, dst, before = {}, {}, None
        for rid, tokens in prompts.items():  # b shares a's first two blocks (the system prompt)
            params, (src[rid],) = prefill(P, f"r30{rid}", 40, tokens=tokens)
            dreq = request(f"d30{rid}", 40, dict(params), 4, tokens=tokens)
            D.sched.add_request(dreq)
            if rid == "b":  # canaries: the cached prefix blocks (a's) must not be written
                before = block_bytes(D, "layer.0", dst["a"][:2])
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="pdxfer.vllm"):
                # freed at once: well inside the 60 s request wait the prefill would otherwise hold
                until(lambda dreq=dreq: (P.step(), D.step()) and dreq.status in LOADED
                      and P.free_blocks() == free_p, f"d30{rid} to load and P to free its blocks",
                      deadline_s=20.0)
            freed_in = time.monotonic() - started
            assert P.call(send_state, f"r30{rid}") is None  # released by vLLM's finished_sending
            assert not P.sched.connector.has_pending_push_work()
            dst[rid] = list(D.sched.kv_cache_manager.get_block_ids(f"d30{rid}")[0])
        assert freed_in < 20.0
        assert dst["b"][:2] == dst["a"][:2]  # the hit: b reuses a's first two blocks
        want = block_bytes(P, "layer.0", src["b"][2:])
        got = block_bytes(D, "layer.0", dst["b"][2:])
        assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))  # the tail landed
        after = block_bytes(D, "layer.0", dst["a"][:2])
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        assert not [r for r in caplog.records if "cached locally" in r.getMessage()]
        for side in (P, D):  # one block of three shipped for b, on both sides' counts
            assert merged(side).data["bytes"] == [3 * BLOCK_BYTES, BLOCK_BYTES]
            assert merged(side).data["failed"] == []
    finally:
        P.close()
        D.close()


def test_a_hybrid_decode_with_prefix_caching_is_refused_at_start_up(model_dir) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import Side

    # a local hit cannot resume a Mamba state, so the decode would compute the prompt itself
    # while its prefill's blocks wait: refused where vLLM builds the connector, by what to change
    for role in ("kv_consumer", "kv_both"):
        side = Side(model_dir, role, hybrid=True, prefix_caching=True, worker_only=True)
        with pytest.raises(ConfigError, match=r"hybrid \(Mamba\) model.*--no-enable-prefix-caching"):
            KVConnectorFactory.create_connector(side.cfg, KVConnectorRole.SCHEDULER, side.kvc)
    # the prefill's own prefix cache is no matter: it ships the state after the whole prompt
    side = Side(model_dir, "kv_producer", hybrid=True, prefix_caching=True, worker_only=True)
    KVConnectorFactory.create_connector(side.cfg, KVConnectorRole.SCHEDULER, side.kvc).shutdown()


# -- item 5: many requests in flight, TP 2, and a TP mismatch refused by name ---------------------
def _prefill_many(P: Engine, n: int) -> tuple[dict, dict]:
    reqs = {f"r{i}": request(f"r{i}", 20, {"do_remote_decode": True}, 1, first=3 + 13 * i)
            for i in range(n)}
    for r in reqs.values():
        P.sched.add_request(r)
    params, src = {}, {}
    while len(params) < n:
        so, eco = P.step()
        for rid in so.num_scheduled_tokens:
            src[rid] = list(P.sched.kv_cache_manager.get_block_ids(rid)[0])
        params.update({o.request_id: o.kv_transfer_params for e in eco.values()
                       for o in e.outputs if o.finished})
    return params, src


def _decode_many(P: Engine, D: Engine, params: dict, src: dict) -> None:
    n = len(params)
    dreqs = {rid: request(f"d{rid}", 20, dict(params[rid]), 2, first=3 + 13 * int(rid[1:]))
             for rid in params}
    for d in dreqs.values():
        D.sched.add_request(d)
    D.step()
    assert sum(d.status is RequestStatus.WAITING_FOR_REMOTE_KVS for d in dreqs.values()) == n
    dst = {rid: list(D.sched.kv_cache_manager.get_block_ids(d.request_id)[0])
           for rid, d in dreqs.items()}
    # done: every decode request loaded, every prefill request's blocks freed (finished_sending)
    until(lambda: (P.step(), D.step()) and all(d.status in LOADED for d in dreqs.values())
          and not any(rid in P.sched.requests for rid in params), f"{n} transfers",
          deadline_s=120.0)
    for rank in range(D.tp):  # rank r's blocks came from prefill rank r, each rank its own bytes
        for rid in params:
            want = P.bytes("layer.0", src[rid], rank=rank)
            got = D.bytes("layer.0", dst[rid], rank=rank)
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (rank, rid)
    assert len(merged(D).data["bytes"]) == D.tp * n and merged(D).data["failed"] == []


def test_64_requests_in_flight_all_land(model_dir) -> None:
    n = 64
    P = Engine(model_dir, "kv_producer", seed=32, blocks=256, max_seqs=n, request_timeout=60.0)
    D = Engine(model_dir, "kv_consumer", seed=33, blocks=256, max_seqs=n, request_timeout=60.0)
    try:
        _decode_many(P, D, *_prefill_many(P, n))  # all 64 Expects out at once, all land
    finally:
        P.close()
        D.close()


def test_tp2_to_tp2_with_64_requests_in_flight_and_a_tp1_decode_refused_by_name(model_dir) -> None:
    n, tp = 64, 2
    kw = {"blocks": 256, "max_seqs": n, "request_timeout": 60.0}
    P = Engine(model_dir, "kv_producer", tp=tp, seed=40, **kw)
    D = Engine(model_dir, "kv_consumer", tp=tp, seed=50, **kw)
    D1 = Engine(model_dir, "kv_consumer", tp=1, seed=60, **{**kw, "request_timeout": 2.0})
    try:
        params, src = _prefill_many(P, n + 1)
        assert all(len(p["remote_addresses"]) == tp for p in params.values())
        odd = params.pop(f"r{n}")
        _decode_many(P, D, params, src)
        other = P.bytes("layer.0", src["r0"], rank=1)  # the ranks hold different bytes
        assert not torch.equal(other[0], P.bytes("layer.0", src["r0"], rank=0)[0])

        # a TP-1 decode handed a TP-2 prefill's request: refused by name, nothing written
        dreq = request("d-odd", 20, dict(odd), 2, first=3 + 13 * n)
        D1.sched.add_request(dreq)
        until(lambda: D1.step() and dreq.is_finished(), "the TP-1 decode to refuse the request")
        assert dreq.status is RequestStatus.FINISHED_ERROR
        refusal = [m for m in D1.call(logged) if "cannot be received" in m]
        assert len(refusal) == 1, D1.call(logged)
        assert "the prefill runs 2 TP ranks, this decode 1" in refusal[0]
        assert "equal TP sizes only" in refusal[0]
    finally:
        for e in (P, D, D1):
            e.close()


# -- item 7: the plugin edge (last: its two interpreters start with the module, see plugin_runs) ----
DRIFTED = r"""
import sys
import vllm
import vllm.distributed.kv_transfer.kv_connector.v1.base as base
del base.SupportsHMA  # a later vLLM renaming one name pdxfer imports, standing in
from vllm.engine.arg_utils import EngineArgs
# vLLM's start-up (what `vllm serve` parses first) runs every vllm.general_plugins entry point,
# without a guard, pdxfer's among them
EngineArgs(model="any-model")
from pdxfer.integrations import vllm as connector
try:
    connector.PdxferConnector(None, None, None)
except ImportError as exc:
    print("REFUSED:", exc)
print("STARTED", vllm.__version__, connector.PdxferConnector.supports_sleep_mode(None))
"""

ABSENT = r"""
import sys
sys.modules["vllm"] = None  # vLLM not installed, as this interpreter sees it
from pdxfer.integrations import vllm as connector
connector.register()
try:
    connector.PdxferConnector(None, None, None)
except ImportError as exc:
    print("REFUSED:", exc)
"""


def _runs(tmp: Path) -> dict[str, tuple]:
    """DRIFTED and ABSENT, each in a fresh interpreter, started now; `_outcome` waits for one.

    Their output goes to files, not pipes: nobody reads a pipe until the test, and a full
    one would stall the interpreter.
    """
    runs = {}
    for name, script in (("drifted", DRIFTED), ("absent", ABSENT)):
        out, err = (open(tmp / f"{name}.{s}", "w+") for s in ("out", "err"))
        proc = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=out, stderr=err)
        runs[name] = (proc, out, err)
    return runs


def _outcome(run: tuple) -> subprocess.CompletedProcess:
    proc, out, err = run
    proc.wait(240)
    for f in (out, err):
        f.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def test_a_drifted_vllm_starts_with_one_warning_naming_the_moved_name_and_the_version(
        plugin_runs) -> None:
    import vllm

    out = _outcome(plugin_runs["drifted"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"STARTED {vllm.__version__} False" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if "pdxfer" in line]
    assert len(warnings) == 1, out.stderr[-3000:]
    name = "vllm.distributed.kv_transfer.kv_connector.v1.base.SupportsHMA"
    for text in (warnings[0], out.stdout):
        assert name in text and f"vLLM {vllm.__version__} is installed" in text
        assert "pip install" not in text  # the advice for an absent vLLM would be wrong here
    assert "REFUSED:" in out.stdout


def test_without_vllm_the_plugin_warns_and_the_connector_says_install_it(plugin_runs) -> None:
    out = _outcome(plugin_runs["absent"])
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "pdxfer" in line]
    assert len(warnings) == 1 and "needs vLLM installed (pip install 'vllm==0.33.*')" in warnings[0]
    assert "REFUSED: pdxfer's vLLM connector needs vLLM installed" in out.stdout
