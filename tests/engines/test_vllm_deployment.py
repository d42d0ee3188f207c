"""pdxfer's vLLM connector as people deploy it (#31): the plugin edge, aborts, load failures,
serving timeouts, identity, metrics, a local prefix hit, many requests in flight.

vLLM's real scheduler in both roles, as tests/engines/vllm_harness.py sets it up.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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
    Side,
    TPSides,
    block_bytes,
    prefill,
    request,
    until,
    write_model,
)

from pdxfer.config import KVPoll
from pdxfer.integrations import vllm as connector_module
from pdxfer.integrations.vllm import PdxferConnector, PdxferKVConnectorStats

BLOCK_BYTES = 2 * 2 * BLOCK * HEADS * HEAD * 2  # both layers' K and V of one block, fp16
# a decode request whose KV loaded: running, or already done with its two tokens
LOADED = (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def merged(side: Side) -> PdxferKVConnectorStats:
    """Everything the side's scheduler handed its loggers, as vLLM's logger rebuilds it."""
    total = PdxferConnector.build_kv_connector_stats()
    for data in side.stats:
        total.aggregate(PdxferConnector.build_kv_connector_stats(data))
    return total


# -- item 7: the plugin edge ------------------------------------------------------------------
DRIFTED = r"""
import sys
import vllm
import vllm.distributed.kv_transfer.kv_connector.v1.base as base
del base.SupportsHMA  # a later vLLM renaming one name pdxfer imports, standing in
from vllm.plugins import load_general_plugins
load_general_plugins()  # every vllm.general_plugins entry point, called without a guard
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


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                          timeout=240)


def test_a_drifted_vllm_starts_with_one_warning_naming_the_moved_name_and_the_version() -> None:
    import vllm

    out = _run(DRIFTED)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"STARTED {vllm.__version__} False" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if "pdxfer" in line]
    assert len(warnings) == 1, out.stderr[-3000:]
    name = "vllm.distributed.kv_transfer.kv_connector.v1.base.SupportsHMA"
    for text in (warnings[0], out.stdout):
        assert name in text and f"vLLM {vllm.__version__} is installed" in text
        assert "pip install" not in text  # the advice for an absent vLLM would be wrong here
    assert "REFUSED:" in out.stdout


def test_without_vllm_the_plugin_warns_and_the_connector_says_install_it() -> None:
    out = _run(ABSENT)
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "pdxfer" in line]
    assert len(warnings) == 1 and "needs vLLM installed (pip install 'vllm==0.33.*')" in warnings[0]
    assert "REFUSED: pdxfer's vLLM connector needs vLLM installed" in out.stdout


# -- item 2: aborts ------------------------------------------------------------------------------
def test_an_abort_while_loading_reaches_the_prefill_within_a_second(model_dir) -> None:
    # Long request waits: without the abort being passed on, nothing would end this for a minute.
    P = Side(model_dir, "kv_producer", seed=21, request_timeout=60.0)
    D = Side(model_dir, "kv_consumer", seed=22, request_timeout=60.0)
    try:
        free_p, free_d = P.free_blocks(), D.free_blocks()
        params, _ = prefill(P, "r21", 40)  # finished; P's next step issues the send
        dreq = request("d21", 40, dict(params), 4)
        D.sched.add_request(dreq)
        D.step()  # allocated, the Expect on its way to P
        assert dreq.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = list(D.sched.kv_cache_manager.get_block_ids("d21")[0])
        before = block_bytes(D, "layer.0", d_blocks)

        started = time.monotonic()
        D.sched.finish_requests("d21", RequestStatus.FINISHED_ABORTED)  # the client went away
        D.step()  # finished_req_ids reaches the worker
        # the prefill's engine has heard (before P sends: else its send would race the abort)
        until(lambda: P.worker.prefill.try_poll("r21") is KVPoll.Failed,
              "the prefill to hear of the abort", deadline_s=5.0)

        def both_freed() -> bool:
            P.step()
            D.step()
            return P.free_blocks() == free_p and D.free_blocks() == free_d

        until(both_freed, "both sides to free the aborted request's blocks", deadline_s=5.0)
        took = time.monotonic() - started
        assert took < 1.0, f"the abort took {took:.2f} s to free the prefill's blocks"
        assert not P.sched.connector.has_pending_push_work()
        after = block_bytes(D, "layer.0", d_blocks)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing landed
        assert "aborted" in merged(D).data["failed"]  # counted, by its cause
    finally:
        P.close()
        D.close()


# -- item 3: load failures -----------------------------------------------------------------------
def test_a_prefill_lost_with_a_request_in_flight_recomputes_exactly_its_blocks(model_dir) -> None:
    P1 = Side(model_dir, "kv_producer", seed=23)
    P2 = Side(model_dir, "kv_producer", seed=24)
    D = Side(model_dir, "kv_consumer", seed=25, policy="recompute", timeout=1.0)
    try:
        ok_params, (ok_src,) = prefill(P1, "ok", 40, first=3)
        bad_params, _ = prefill(P2, "bad", 40, first=300)
        d_ok = request("d-ok", 40, dict(ok_params), 4, first=3)
        d_bad = request("d-bad", 40, dict(bad_params), 4, first=300)
        D.sched.add_request(d_ok)
        D.sched.add_request(d_bad)
        D.step()
        assert d_ok.status is d_bad.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        ok_blocks = list(D.sched.kv_cache_manager.get_block_ids("d-ok")[0])
        bad_blocks = list(D.sched.kv_cache_manager.get_block_ids("d-bad")[0])
        until(lambda: P2.worker.prefill.try_poll("bad") is not None, "P2 to hold d-bad's Expect")
        P2.worker.shutdown()  # the prefill goes away with d-bad's blocks not shipped

        reported: list[set[int]] = []
        real = D.worker.get_block_ids_with_load_errors

        def spy() -> set[int]:
            got = real()
            reported.append(set(got))
            return got

        D.worker.get_block_ids_with_load_errors = spy
        recomputed: dict[str, int] = {}

        def settled() -> bool:
            P1.step()
            so, _ = D.step()
            if "d-bad" in so.num_scheduled_tokens:
                recomputed.setdefault("d-bad", so.num_scheduled_tokens["d-bad"])
            return d_ok.status is RequestStatus.RUNNING and "d-bad" in recomputed

        until(settled, "d-ok to load and d-bad to be recomputed")
        assert set().union(*reported) == set(bad_blocks)  # exactly the failed request's blocks
        assert not set(ok_blocks) & set().union(*reported)
        assert recomputed["d-bad"] == 40  # every block of it failed: its whole prompt
        assert d_bad.status is RequestStatus.RUNNING  # recomputed, not failed
        want = block_bytes(P1, "layer.1", ok_src)
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(D, "layer.1", ok_blocks),
                                                     strict=True))
    finally:
        P1.close()
        P2.close()
        D.close()


# -- item 4: timeouts ----------------------------------------------------------------------------
def test_the_request_wait_is_serving_sized_unless_set_and_the_liveness_bound_stays_short(model_dir) -> None:
    by_default = Side(model_dir, "kv_consumer", timeout=3.0, request_timeout=None)
    chosen = Side(model_dir, "kv_consumer", timeout=3.0, request_timeout=7.0)
    try:
        assert by_default.worker.config.request_wait == connector_module.SERVING_REQUEST_TIMEOUT == 300.0
        assert by_default.worker.config.timeout == 3.0  # a dead peer still fails in seconds
        assert chosen.worker.config.request_wait == 7.0
    finally:
        by_default.close()
        chosen.close()


# -- items 6 and 8: metrics, identity ------------------------------------------------------------
def _prom(cfg) -> tuple[CollectorRegistry, object]:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    return reg, PdxferConnector.build_prom_metrics(cfg, types, ["model_name", "engine"],
                                                   {0: ["m", "0"]})


def test_the_stats_and_prometheus_series_read_back_what_was_moved(model_dir) -> None:
    P, D = Side(model_dir, "kv_producer", seed=26), Side(model_dir, "kv_consumer", seed=27)
    try:
        params, _ = prefill(P, "r26", 40)
        dreq = request("d26", 40, dict(params), 4)
        D.sched.add_request(dreq)

        def done() -> bool:
            P.step()
            D.step()
            return dreq.status is RequestStatus.RUNNING and "r26" not in P.sched.requests

        until(done, "the transfer")
        sent, got = merged(P), merged(D)
        for s in (sent, got):  # vLLM's scheduler carried them to its loggers, both roles alike
            assert s.data["bytes"] == [3 * BLOCK_BYTES] and s.data["failed"] == []
            assert len(s.data["transfer_s"]) == 1 and s.data["transfer_s"][0] > 0
        assert sent.data["segments"] == got.data["segments"] and sent.data["segments"][0] > 0
        line = got.reduce()
        assert line["Num successful transfers"] == 1 and line["Num failed transfers"] == 0
        assert line["Avg MB per transfer"] == round(3 * BLOCK_BYTES / 2**20, 3)

        reg, prom = _prom(D.cfg)
        prom.observe(got.data, 0)
        labels = {"model_name": "m", "engine": "0"}
        assert reg.get_sample_value("vllm:pdxfer_bytes_transferred_sum", labels) == 3 * BLOCK_BYTES
        assert reg.get_sample_value("vllm:pdxfer_bytes_transferred_count", labels) == 1
        assert reg.get_sample_value("vllm:pdxfer_transfer_time_seconds_sum", labels) == pytest.approx(
            got.data["transfer_s"][0])

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


def test_engines_serving_different_models_are_refused_by_name(model_dir, tmp_path, caplog) -> None:
    other = write_model(tmp_path / "another-model")  # same shapes: only the identity tells
    assert PdxferConnector.get_required_kvcache_layout(None) is None
    P = Side(model_dir, "kv_producer", seed=28, timeout=1.0, request_timeout=1.0)
    D = Side(other, "kv_consumer", seed=29)
    try:
        assert get_kv_connector_cache_layout(D.cfg) == "LBNHC"  # what vLLM asks its backends for
        params, _ = prefill(P, "r28", 40)
        before = D.caches["layer.0"].clone().view(torch.int16)
        dreq = request("d28", 40, dict(params), 4)
        D.sched.add_request(dreq)
        with caplog.at_level(logging.WARNING, logger="pdxfer.vllm"):
            until(lambda: D.step() and dreq.is_finished(), "the decode request to be refused")
        assert dreq.status is RequestStatus.FINISHED_ERROR
        assert torch.equal(before, D.caches["layer.0"].view(torch.int16))  # not a byte written
        refusal = [r.getMessage() for r in caplog.records if "transfer of d28 failed" in r.getMessage()]
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
def test_a_local_prefix_hit_on_the_decode_loads_only_the_tail(model_dir, caplog) -> None:
    P, D = Side(model_dir, "kv_producer", seed=30), Side(model_dir, "kv_consumer", seed=31)
    try:
        src, dst, before = {}, {}, None
        for rid in ("a", "b"):  # the same prompt twice: b's first two blocks are cached on D
            params, src[rid] = prefill(P, f"r30{rid}", 40)
            dreq = request(f"d30{rid}", 40, dict(params), 4)
            D.sched.add_request(dreq)
            if rid == "b":  # canaries: the cached prefix blocks (a's) must not be written
                before = block_bytes(D, "layer.0", dst["a"][:2])
            with caplog.at_level(logging.WARNING, logger="pdxfer.vllm"):
                until(lambda dreq=dreq: (P.step(), D.step()) and dreq.status is RequestStatus.RUNNING
                      and not P.sched.connector.has_pending_push_work(), f"d30{rid} to run")
            dst[rid] = list(D.sched.kv_cache_manager.get_block_ids(f"d30{rid}")[0])
        assert dst["b"][:2] == dst["a"][:2]  # the hit: b reuses a's first two blocks
        want = block_bytes(P, "layer.0", src["b"][0][2:])
        got = block_bytes(D, "layer.0", dst["b"][2:])
        assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))  # the tail landed
        after = block_bytes(D, "layer.0", dst["a"][:2])
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        assert not [r for r in caplog.records if "cached locally" in r.getMessage()]
        assert merged(D).data["prefix_fallbacks"] == []
        assert len(merged(D).data["bytes"]) == 2 and merged(D).data["failed"] == []
        assert merged(D).data["bytes"][1] * 3 == merged(D).data["bytes"][0]  # one block of three
    finally:
        P.close()
        D.close()


# -- item 5: many requests in flight, and a TP mismatch refused by name ---------------------------
def test_64_requests_in_flight_all_land(model_dir) -> None:
    n = 64
    P = Side(model_dir, "kv_producer", seed=32, blocks=256, max_seqs=n, request_timeout=60.0)
    D = Side(model_dir, "kv_consumer", seed=33, blocks=256, max_seqs=n, request_timeout=60.0)
    try:
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
        dreqs = {rid: request(f"d{rid}", 20, dict(params[rid]), 2, first=3 + 13 * int(rid[1:]))
                 for rid in reqs}
        for d in dreqs.values():
            D.sched.add_request(d)
        D.step()
        waiting = sum(d.status is RequestStatus.WAITING_FOR_REMOTE_KVS for d in dreqs.values())
        assert waiting == n  # all 64 Expects out at once
        dst = {rid: list(D.sched.kv_cache_manager.get_block_ids(d.request_id)[0])
               for rid, d in dreqs.items()}

        def all_landed() -> bool:
            P.step()
            D.step()
            return (all(d.status in LOADED for d in dreqs.values())
                    and not P.sched.connector.has_pending_push_work())

        until(all_landed, "64 transfers", deadline_s=60.0)
        for rid in reqs:
            want, got = block_bytes(P, "layer.0", src[rid]), block_bytes(D, "layer.0", dst[rid])
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), rid
        assert len(merged(D).data["bytes"]) == n and merged(D).data["failed"] == []
    finally:
        P.close()
        D.close()


def test_a_prefill_of_another_tp_size_is_refused_by_name(model_dir, caplog) -> None:
    P, D = Side(model_dir, "kv_producer", seed=34), Side(model_dir, "kv_consumer", seed=35)
    try:
        params, _ = prefill(P, "r34", 40)
        # what a TP-2 prefill's params carry: one address per rank
        params = {**params, "remote_addresses": params["remote_addresses"] * 2, "tp_size": 2}
        dreq = request("d34", 40, params, 4)
        D.sched.add_request(dreq)
        with caplog.at_level(logging.ERROR, logger="pdxfer.vllm"):
            until(lambda: D.step() and dreq.is_finished(), "the decode request to be refused")
        assert dreq.status is RequestStatus.FINISHED_ERROR
        assert any("the prefill runs 2 TP ranks, this decode 1" in r.getMessage()
                   and "equal TP sizes only" in r.getMessage() for r in caplog.records)
    finally:
        P.close()
        D.close()


@pytest.mark.timeout(400)  # two worker processes importing vLLM: a minute of it under load
def test_tp2_to_tp2_with_worker_processes_and_64_requests_in_flight(model_dir) -> None:
    n, tp = 64, 2
    tps = TPSides(model_dir, tp=tp, blocks=256, max_seqs=n, request_timeout=60.0)
    P, D = tps.sides["kv_producer"], tps.sides["kv_consumer"]
    try:
        assert len(P.sched.connector._addresses) == tp
        reqs = {f"r{i}": request(f"r{i}", 20, {"do_remote_decode": True}, 1, first=3 + 13 * i)
                for i in range(n)}
        for r in reqs.values():
            P.sched.add_request(r)
        params, src = {}, {}
        while len(params) < n:
            so, eco = tps.step("kv_producer")
            for rid in so.num_scheduled_tokens:
                src[rid] = list(P.sched.kv_cache_manager.get_block_ids(rid)[0])
            params.update({o.request_id: o.kv_transfer_params for e in eco.values()
                           for o in e.outputs if o.finished})
        assert all(len(p["remote_addresses"]) == tp for p in params.values())
        dreqs = {rid: request(f"d{rid}", 20, dict(params[rid]), 2, first=3 + 13 * int(rid[1:]))
                 for rid in reqs}
        for d in dreqs.values():
            D.sched.add_request(d)
        tps.step("kv_consumer")
        assert all(d.status is RequestStatus.WAITING_FOR_REMOTE_KVS for d in dreqs.values())
        dst = {rid: list(D.sched.kv_cache_manager.get_block_ids(d.request_id)[0])
               for rid, d in dreqs.items()}

        def all_landed() -> bool:
            tps.step("kv_producer")
            tps.step("kv_consumer")
            return (all(d.status in LOADED for d in dreqs.values())
                    and not P.sched.connector.has_pending_push_work())

        until(all_landed, "64 transfers at TP 2", deadline_s=90.0)
        for rank in range(tp):  # rank r's blocks came from prefill rank r, each rank its own bytes
            for rid in reqs:
                want = tps.bytes("kv_producer", rank, "layer.0", src[rid])
                got = tps.bytes("kv_consumer", rank, "layer.0", dst[rid])
                assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (rank, rid)
        other = tps.bytes("kv_producer", 1, "layer.0", src["r0"])  # the ranks hold different bytes
        assert not torch.equal(other[0], tps.bytes("kv_producer", 0, "layer.0", src["r0"])[0])
        # vLLM's aggregator folded both ranks' stats: a transfer per rank per request
        assert len(merged(D).data["bytes"]) == tp * n and merged(D).data["failed"] == []
    finally:
        tps.close()
        P.close()
        D.close()
