"""pdxfer as vLLM 0.33's KV connector, driven by vLLM's real scheduler in both roles, each
engine's worker-side connector in a process of its own.

What is real and what is simulated: tests/engines/vllm_harness.py.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.request import RequestStatus
from vllm_harness import (
    HEAD,
    Engine,
    block_bytes,
    prefill,
    prefill_address,
    request,
    until,
    write_model,
)

from pdxfer.integrations import vllm as connector_module

# Generous: the first test may wait for the fork server's one import of vLLM (vllm_forkserver),
# a minute or more with both cores busy.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def test_the_connector_loads_by_module_path_and_by_entry_point(model_dir) -> None:
    from importlib.metadata import entry_points

    side = Engine(model_dir, "kv_producer")
    try:
        assert type(side.sched.connector) is connector_module.PdxferConnector
        assert supports_hma(side.sched.connector)
        assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "pdxfer"] == [
            "pdxfer.integrations.vllm:register"]
        connector_module.register()
        connector_module.register()  # once per process is vLLM's habit; twice must not raise
        cfg = KVTransferConfig(kv_connector="PdxferConnector", kv_role="kv_consumer")
        assert KVConnectorFactory.get_connector_class(cfg) is connector_module.PdxferConnector
    finally:
        side.close()


def test_a_remote_prefill_moves_the_decode_request_to_running_and_frees_the_prefill_blocks(model_dir) -> None:
    P, D = Engine(model_dir, "kv_producer", seed=1), Engine(model_dir, "kv_consumer", seed=2)
    try:
        free = P.free_blocks()
        params, (p_blocks,) = prefill(P, "r1", 40)
        assert params["do_remote_prefill"] and params["remote_request_id"] == "r1"
        assert params["remote_addresses"] == [P.call(prefill_address)]
        assert P.free_blocks() == free - 3  # held for the decode (delay free)
        want = block_bytes(P, "layer.1", p_blocks)

        dreq = request("d1", 40, dict(params), 4)  # the proxy hands the params over
        D.sched.add_request(dreq)
        so, _ = D.step()
        assert dreq.status is RequestStatus.WAITING_FOR_REMOTE_KVS and so.num_scheduled_tokens == {}
        d_blocks = list(D.sched.kv_cache_manager.get_block_ids("d1")[0])
        assert len(d_blocks) == 3

        def both_done() -> bool:
            P.step()
            D.step()
            return dreq.status is RequestStatus.RUNNING and "r1" not in P.sched.requests

        until(both_done, "the decode to run and the prefill to free its blocks")
        assert P.free_blocks() == free  # freed only after finished_sending
        got = block_bytes(D, "layer.1", d_blocks)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert dreq.num_computed_tokens >= 40 - 1  # loaded; at most the last token recomputed
    finally:
        P.close()
        D.close()


def test_a_failed_transfer_fails_the_decode_request_and_frees_both_sides(model_dir) -> None:
    # The decode's layer shape differs: pdxfer's handshake refuses it, nothing is written.
    P = Engine(model_dir, "kv_producer", seed=3, timeout=1.0, request_timeout=1.0)
    D = Engine(model_dir, "kv_consumer", seed=4, head=2 * HEAD)
    try:
        free_p, free_d = P.free_blocks(), D.free_blocks()
        params, _ = prefill(P, "r2", 40)
        before = block_bytes(D, "layer.0", list(range(D.side.blocks)))
        dreq = request("d2", 40, dict(params), 4)
        D.sched.add_request(dreq)

        def failed() -> bool:
            D.step()
            return dreq.is_finished()

        until(failed, "the decode request to fail")
        assert dreq.status is RequestStatus.FINISHED_ERROR  # vLLM's default load-failure policy
        after = block_bytes(D, "layer.0", list(range(D.side.blocks)))
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written
        until(lambda: D.step() and D.free_blocks() == free_d, "the decode blocks to be freed")
        # the prefill's send never finds its decode: held until pdxfer's request timeout, then freed
        assert P.free_blocks() < free_p and P.sched.connector.has_pending_push_work()
        until(lambda: P.step() and P.free_blocks() == free_p, "the prefill blocks to be freed")
        assert not P.sched.connector.has_pending_push_work()
    finally:
        P.close()
        D.close()


def test_a_hybrid_model_ships_attention_blocks_and_the_mamba_state(model_dir) -> None:
    P = Engine(model_dir, "kv_producer", hybrid=True, seed=5)
    D = Engine(model_dir, "kv_consumer", hybrid=True, seed=6)
    try:
        assert len(P.side.kvc.kv_cache_groups) == 2 and not P.cfg.scheduler_config.disable_hybrid_kv_cache_manager
        params, blocks = prefill(P, "r3", 40)
        # the prefill stopped one token short: the decode recomputes it on top of h(N-1)
        assert params["remote_num_tokens"] == 39
        sent = P.sched.connector._transfer_blocks(blocks)
        want_attn = block_bytes(P, "layer.0", sent[0])
        want_state = block_bytes(P, "layer.1", sent[1])
        assert len(sent[1]) == 1  # only the running-state block of the Mamba group
        dreq = request("d3", 40, dict(params), 4)
        D.sched.add_request(dreq)
        D.step()
        # the decode's blocks, clipped as its connector clips them for the Expect
        d_blocks = D.sched.connector._transfer_blocks(D.sched.kv_cache_manager.get_block_ids("d3"))

        def running() -> bool:
            P.step()
            D.step()
            return dreq.status is RequestStatus.RUNNING

        until(running, "the hybrid decode request to run")
        assert all(torch.equal(a, b) for a, b in zip(want_attn, block_bytes(D, "layer.0", d_blocks[0]),
                                                     strict=True))
        assert all(torch.equal(a, b) for a, b in zip(want_state, block_bytes(D, "layer.1", d_blocks[1]),
                                                     strict=True))
    finally:
        P.close()
        D.close()
