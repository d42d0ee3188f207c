"""vLLM's save_kv_layer / wait_for_save driving streamed layer groups (#33), in vLLM's real scheduler.

The forward pass is simulated as in the harness, with one difference: between
vLLM's binding of the step's metadata and its wait_for_save, the test calls
`save_kv_layer` per layer, as the attention layers would
(`KVConnectorModelRunnerMixin._get_kv_connector_output`, vLLM's own context).
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm_harness import Side, block_bytes, request, until, write_model

from pdxfer.errors import UnknownRequestError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


class Local(Side):
    """One engine's scheduler and its (TP 1) worker connector in this process.

    The other tests run each worker in a process of its own (`vllm_harness.Engine`);
    here the test itself is the forward pass, calling `save_kv_layer` per layer inside
    vLLM's forward context, so the worker connector must live where the test runs.
    """

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.start_worker()
        if self.sched.connector._producer:  # what EngineCore does with its workers' metadata
            self.sched.connector.set_xfer_handshake_metadata_pp_aware(
                {(0, 0): self.worker.get_handshake_metadata()})

    def step(self):
        """One engine step: schedule, the worker's connector turn (no forward), update."""
        so = self.sched.schedule()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # ensure_kv_transfer_initialized's job
        return self.finish_step(so, KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg))

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.connector.shutdown()


def _known(engine, rid: str) -> bool:
    try:
        engine.poll(rid)
        return True
    except UnknownRequestError:
        return False


def test_a_prefill_streams_its_blocks_by_layer_during_the_forward_and_the_decode_gets_them(
        model_dir) -> None:
    P = Local(model_dir, "kv_producer", seed=1, extra={"pdxfer_layer_groups": 2})
    D = Local(model_dir, "kv_consumer", seed=2)
    try:
        free = P.free_blocks()
        P.sched.add_request(request("r1", 40, {"do_remote_decode": True}, 1))
        so = P.sched.schedule()
        assert list(so.kv_connector_metadata.stream) == ["r1"]  # prefilled whole in this step
        blocks = list(P.sched.kv_cache_manager.get_block_ids("r1")[0])
        kv_transfer_state._KV_CONNECTOR_AGENT = P.worker
        seen = []
        with set_forward_context(None, P.cfg), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo:
            for layer in ("layer.0", "layer.1"):  # the forward pass, layer by layer
                P.worker.save_kv_layer(layer, None, None)
                seen.append(_known(P.worker.prefill, "r1"))
        assert seen == [True, True], "layer.0's group was not sent during the forward"
        _, eco = P.finish_step(so, ModelRunnerOutput.with_kv_conn_output_only(kvo))
        params = next(o.kv_transfer_params for e in eco.values() for o in e.outputs if o.finished)
        assert params["remote_request_id"] == "r1" and P.free_blocks() == free - 3  # held
        want = {layer: block_bytes(P, layer, blocks) for layer in ("layer.0", "layer.1")}

        dreq = request("d1", 40, dict(params), 4)
        D.sched.add_request(dreq)
        D.step()
        d_blocks = list(D.sched.kv_cache_manager.get_block_ids("d1")[0])

        def both_done() -> bool:
            P.step()
            D.step()
            return dreq.status is RequestStatus.RUNNING and "r1" not in P.sched.requests

        until(both_done, "the decode to run and the prefill to free its blocks")
        assert P.free_blocks() == free
        for layer in ("layer.0", "layer.1"):
            got = block_bytes(D, layer, d_blocks)
            assert all(torch.equal(a, b) for a, b in zip(want[layer], got, strict=True)), layer
        assert P.stats and P.worker.prefill is not None
    finally:
        P.close()
        D.close()


def test_a_chunked_prompt_is_not_streamed_and_is_pushed_whole(model_dir) -> None:
    P = Local(model_dir, "kv_producer", seed=3, extra={"pdxfer_layer_groups": 2})
    try:
        P.sched.add_request(request("long", 400, {"do_remote_decode": True}, 1))  # 256 per step
        so = P.sched.schedule()
        assert so.kv_connector_metadata.stream == {}
    finally:
        P.close()


def test_a_bad_knob_is_refused_by_name(model_dir) -> None:
    from pdxfer.errors import ConfigError
    with pytest.raises(ConfigError, match="pdxfer_layer_groups must be an int >= 0"):
        Side(model_dir, "kv_producer", extra={"pdxfer_layer_groups": "four"})
