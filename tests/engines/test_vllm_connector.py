"""pdxfer as vLLM 0.33's KV connector, driven by vLLM's real scheduler in both roles.

Real (vLLM, imported): `VllmConfig`/`ModelConfig` (a local two-layer
config.json; nothing is downloaded), `KVConnectorFactory` loading
`PdxferConnector` by module path, the `Scheduler` (schedule /
update_from_output, its KV cache manager and block pool,
`WAITING_FOR_REMOTE_KVS`, delayed block freeing), `Request`, and the worker
connector's lifecycle through `KVConnectorModelRunnerMixin.kv_connector_no_forward`
(bind metadata, `start_load_kv`, `wait_for_save`, `get_transfer_results`).
pdxfer moves the bytes between the prefill and the decode worker over tcp
on 127.0.0.1 (one process holds both: each side has its own engine).

Simulated: the forward pass (a hand-built `ModelRunnerOutput` sampling token
7), the KV tensors (CPU tensors in the attention backend's `[2, blocks,
block_size, heads, head_size]` shape, and for the hybrid case Mamba state
views sharing each block's page of one raw buffer, as vLLM's hybrid
allocator lays them out), the executor's collection of worker handshake
metadata, the GPU platform's leaving the hybrid KV cache manager on (the CPU
platform turns it off), and the proxy that copies `kv_transfer_params` from the prefill's
output into the decode's request.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from pdxfer.integrations import vllm as connector_module

BLOCK, BLOCKS, HEADS, HEAD = 16, 64, 2, 16
CONV, SSM = (32, 3), (2, 8, 8)  # a Mamba layer's conv and ssm state per block (fp16)

init_none_hash(sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}))
    return str(path)


class Side:
    """One vLLM engine's scheduler and its one worker's connector, stepped without a model."""

    def __init__(self, model_dir: str, role: str, *, hybrid: bool = False, head: int = HEAD,
                 timeout: float = 2.0, seed: int = 0) -> None:
        pdxfer = {"transport": "tcp", "host": "127.0.0.1", "timeout": timeout}
        self.cfg = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                                     seed=42),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                             max_model_len=1024, is_encoder_decoder=False,
                                             enable_chunked_prefill=True,
                                             disable_hybrid_kv_cache_manager=None if hybrid else True),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=not hybrid),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.integrations.vllm",
                kv_role=role, kv_connector_extra_config={"pdxfer": pdxfer}),
            device_config=DeviceConfig("cpu"))
        if hybrid:
            # vLLM's CPU platform turns HMA off; the GPU platform leaves it on when the connector
            # supports it, which is the decision simulated here (and asked of the factory).
            assert KVConnectorFactory.supports_hma_config(self.cfg.kv_transfer_config)
            self.cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=head,
                                 dtype=torch.float16)
        groups = [KVCacheGroupSpec(["layer.0"] if hybrid else ["layer.0", "layer.1"], attn)]
        if hybrid:  # layer.1 is a Mamba layer whose page is padded to the attention page
            mamba = MambaSpec(block_size=BLOCK, shapes=(CONV, SSM), dtypes=(torch.float16,) * 2,
                              page_size_padded=attn.page_size_bytes)
            groups.append(KVCacheGroupSpec(["layer.1"], mamba))
        self.kvc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        self.cfg.cache_config.num_gpu_blocks = BLOCKS
        self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kvc,
                               structured_output_manager=StructuredOutputManager(self.cfg),
                               block_size=BLOCK, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kvc)
        self.caches = self._allocate(attn, hybrid, seed)
        self.worker.register_kv_caches(self.caches)
        # what EngineCore does after registration: the workers' handshake metadata to the scheduler
        meta = self.worker.get_handshake_metadata()
        if meta is not None:
            self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})

    @staticmethod
    def _allocate(attn, hybrid: bool, seed: int) -> dict:
        """Per-layer caches as vLLM allocates them: one raw buffer per layer, viewed per spec."""
        gen = torch.Generator().manual_seed(seed)
        page = attn.page_size_bytes
        caches = {}
        for name in (["layer.0"] if hybrid else ["layer.0", "layer.1"]):
            raw = torch.randint(0, 255, (BLOCKS * page,), dtype=torch.uint8, generator=gen)
            caches[name] = raw.view(torch.float16).view(2, BLOCKS, BLOCK, HEADS, attn.head_size)
        if hybrid:
            raw = torch.randint(0, 255, (BLOCKS * page,), dtype=torch.uint8, generator=gen)
            conv_n, ssm_n = CONV[0] * CONV[1], SSM[0] * SSM[1] * SSM[2]
            conv = torch.as_strided(raw.view(torch.float16), (BLOCKS, *CONV), (page // 2, CONV[1], 1))
            ssm = torch.as_strided(raw.view(torch.float16), (BLOCKS, *SSM),
                                   (page // 2, SSM[1] * SSM[2], SSM[2], 1), conv_n)
            assert conv_n + ssm_n <= page // 2
            caches["layer.1"] = [conv, ssm]
        return caches

    def step(self, sampled: dict[str, list[int]] | None = None):
        """One engine step: schedule, the worker's connector turn (no forward), update."""
        so = self.sched.schedule()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # ensure_kv_transfer_initialized's job
        out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg)
        ids = list(so.num_scheduled_tokens)
        if ids:  # the forward pass, simulated: every scheduled request samples token 7
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[7] for _ in ids], logprobs=None,
                                    prompt_logprobs_dict={}, pooler_output=None,
                                    kv_connector_output=out.kv_connector_output)
        return so, self.sched.update_from_output(so, out)

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.connector.shutdown()


def request(rid: str, n: int, params: dict, max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    r = Request(request_id=rid, prompt_token_ids=list(range(3, 3 + n)), sampling_params=sp,
                pooling_params=None, mm_features=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = params
    return r


def prefill(side: Side, rid: str, n: int) -> tuple[dict, list[list[int]]]:
    """Run a prefill request to its end; its kv_transfer_params and its (held) blocks."""
    req = request(rid, n, {"do_remote_decode": True}, 1)
    side.sched.add_request(req)
    blocks = None
    outputs = {}
    while not outputs:
        so, eco = side.step()
        if rid in so.num_scheduled_tokens:
            blocks = side.sched.kv_cache_manager.get_block_ids(rid)
        outputs = {o.request_id: o for e in eco.values() for o in e.outputs if o.finished}
    return outputs[rid].kv_transfer_params, [list(b) for b in blocks]


def until(fn, what: str, deadline_s: float = 30.0):
    deadline = time.monotonic() + deadline_s
    while not (out := fn()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.002)
    return out


def block_bytes(side: Side, layer: str, blocks: list[int]) -> list[torch.Tensor]:
    """The blocks' bytes per tensor (as int16: random bits make NaNs, and NaN != NaN)."""
    cache = side.caches[layer]
    parts = cache if isinstance(cache, list) else [cache[0], cache[1]]
    return [t[blocks].contiguous().view(torch.int16) for t in parts]


def test_the_connector_loads_by_module_path_and_by_entry_point(model_dir) -> None:
    from importlib.metadata import entry_points

    side = Side(model_dir, "kv_producer")
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
    P, D = Side(model_dir, "kv_producer", seed=1), Side(model_dir, "kv_consumer", seed=2)
    try:
        free = P.free_blocks()
        params, (p_blocks,) = prefill(P, "r1", 40)
        assert params["do_remote_prefill"] and params["remote_request_id"] == "r1"
        assert params["remote_addresses"] == [P.worker.prefill.bootstrap_address]
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
    P = Side(model_dir, "kv_producer", seed=3, timeout=1.0)
    D = Side(model_dir, "kv_consumer", seed=4, head=2 * HEAD)
    try:
        free_p, free_d = P.free_blocks(), D.free_blocks()
        params, _ = prefill(P, "r2", 40)
        before = D.caches["layer.0"].clone().view(torch.int16)
        dreq = request("d2", 40, dict(params), 4)
        D.sched.add_request(dreq)

        def failed() -> bool:
            D.step()
            return dreq.is_finished()

        until(failed, "the decode request to fail")
        assert dreq.status is RequestStatus.FINISHED_ERROR  # vLLM's default load-failure policy
        assert torch.equal(before, D.caches["layer.0"].view(torch.int16))  # not a byte written
        until(lambda: D.step() and D.free_blocks() == free_d, "the decode blocks to be freed")
        # the prefill's send never finds its decode: held until pdxfer's request timeout, then freed
        assert P.free_blocks() < free_p and P.sched.connector.has_pending_push_work()
        until(lambda: P.step() and P.free_blocks() == free_p, "the prefill blocks to be freed")
        assert not P.sched.connector.has_pending_push_work()
    finally:
        P.close()
        D.close()


def test_a_hybrid_model_ships_attention_blocks_and_the_mamba_state(model_dir) -> None:
    P = Side(model_dir, "kv_producer", hybrid=True, seed=5)
    D = Side(model_dir, "kv_consumer", hybrid=True, seed=6)
    try:
        assert len(P.kvc.kv_cache_groups) == 2 and not P.cfg.scheduler_config.disable_hybrid_kv_cache_manager
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
