"""vLLM 0.33's scheduler and worker connector, stepped without a model: what the vLLM tests share.

Real (vLLM, imported): `VllmConfig`/`ModelConfig` (a local two-layer
config.json; nothing is downloaded), `KVConnectorFactory` loading
`PdxferConnector` by module path, the `Scheduler` (schedule /
update_from_output, its KV cache manager and block pool, prefix caching,
`WAITING_FOR_REMOTE_KVS`, delayed block freeing, the load-failure policy,
the stats it hands its loggers), `Request`, and the worker connector's
lifecycle through `KVConnectorModelRunnerMixin.kv_connector_no_forward`
(bind metadata, `start_load_kv`, `wait_for_save`, `get_transfer_results`,
`get_block_ids_with_load_errors`, `get_kv_connector_stats`). pdxfer moves
the bytes between the prefill and the decode worker over tcp on 127.0.0.1
(one process holds both: each side has its own engine).

Simulated: the forward pass (a hand-built `ModelRunnerOutput` sampling token
7), the KV tensors (CPU tensors in the attention backend's `[2, blocks,
block_size, heads, head_size]` shape, and for the hybrid case Mamba state
views sharing each block's page of one raw buffer, as vLLM's hybrid
allocator lays them out), the executor's collection of worker handshake
metadata, the GPU platform's leaving the hybrid KV cache manager on (the CPU
platform turns it off), and the proxy that copies `kv_transfer_params` from
the prefill's output into the decode's request.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
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
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

BLOCK, BLOCKS, HEADS, HEAD = 16, 64, 2, 16
CONV, SSM = (32, 3), (2, 8, 8)  # a Mamba layer's conv and ssm state per block (fp16)

init_none_hash(sha256)


def write_model(path: Path) -> str:
    """A two-layer Llama config.json (no weights: nothing is loaded or downloaded)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}))
    return str(path)


class Side:
    """One vLLM engine's scheduler and its one worker's connector, stepped without a model."""

    def __init__(self, model_dir: str, role: str, *, hybrid: bool = False, head: int = HEAD,
                 timeout: float = 2.0, request_timeout: float | None = 2.0, seed: int = 0,
                 blocks: int = BLOCKS, max_seqs: int = 8, policy: str = "fail",
                 prefix_caching: bool | None = None, tp: int = 1, scheduler_only: bool = False,
                 worker_only: bool = False, extra: dict | None = None) -> None:
        pdxfer = {"transport": "tcp", "host": "127.0.0.1", "timeout": timeout}
        if request_timeout is not None:
            pdxfer["request_timeout"] = request_timeout
        self.cfg = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                                     seed=42),
            scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256,
                                             max_model_len=1024, is_encoder_decoder=False,
                                             enable_chunked_prefill=True,
                                             disable_hybrid_kv_cache_manager=None if hybrid else True),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=(
                not hybrid if prefix_caching is None else prefix_caching)),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.integrations.vllm",
                kv_role=role, kv_connector_extra_config={"pdxfer": pdxfer, **(extra or {})},
                kv_load_failure_policy=policy),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            device_config=DeviceConfig("cpu"))
        if hybrid:
            # vLLM's CPU platform turns HMA off; the GPU platform leaves it on when the connector
            # supports it, which is the decision simulated here (and asked of the factory).
            assert KVConnectorFactory.supports_hma_config(self.cfg.kv_transfer_config)
            self.cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        self.blocks = blocks
        attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=head,
                                 dtype=torch.float16)
        groups = [KVCacheGroupSpec(["layer.0"] if hybrid else ["layer.0", "layer.1"], attn)]
        if hybrid:  # layer.1 is a Mamba layer whose page is padded to the attention page
            mamba = MambaSpec(block_size=BLOCK, shapes=(CONV, SSM), dtypes=(torch.float16,) * 2,
                              page_size_padded=attn.page_size_bytes)
            groups.append(KVCacheGroupSpec(["layer.1"], mamba))
        self.kvc = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.cfg.cache_config.num_gpu_blocks = blocks
        self._attn, self._hybrid, self._seed = attn, hybrid, seed
        self.stats: list[dict] = []  # what the scheduler handed its loggers, step by step
        self.worker = None
        if not worker_only:
            self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kvc,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=BLOCK, log_stats=True)
        if scheduler_only or worker_only:
            return  # TPSides: the workers run in their own processes
        self.start_worker()
        # what EngineCore does after registration: the workers' handshake metadata to the scheduler
        meta = self.worker.get_handshake_metadata()
        if meta is not None:
            self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})

    def start_worker(self) -> None:
        """The worker-side connector over freshly allocated (seeded random) caches."""
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kvc)
        self.caches = self._allocate(self._attn, self._hybrid, self._seed)
        self.worker.register_kv_caches(self.caches)

    def _allocate(self, attn, hybrid: bool, seed: int) -> dict:
        """Per-layer caches as vLLM allocates them: one raw buffer per layer, viewed per spec."""
        gen = torch.Generator().manual_seed(seed)
        page, n = attn.page_size_bytes, self.blocks
        caches = {}
        for name in (["layer.0"] if hybrid else ["layer.0", "layer.1"]):
            raw = torch.randint(0, 255, (n * page,), dtype=torch.uint8, generator=gen)
            caches[name] = raw.view(torch.float16).view(2, n, BLOCK, HEADS, attn.head_size)
        if hybrid:
            raw = torch.randint(0, 255, (n * page,), dtype=torch.uint8, generator=gen)
            conv_n, ssm_n = CONV[0] * CONV[1], SSM[0] * SSM[1] * SSM[2]
            conv = torch.as_strided(raw.view(torch.float16), (n, *CONV), (page // 2, CONV[1], 1))
            ssm = torch.as_strided(raw.view(torch.float16), (n, *SSM),
                                   (page // 2, SSM[1] * SSM[2], SSM[2], 1), conv_n)
            assert conv_n + ssm_n <= page // 2
            caches["layer.1"] = [conv, ssm]
        return caches

    def step(self, sampled: dict[str, list[int]] | None = None):
        """One engine step: schedule, the worker's connector turn (no forward), update."""
        so = self.sched.schedule()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # ensure_kv_transfer_initialized's job
        return self.finish_step(so, KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.cfg))

    def finish_step(self, so, out):
        """The simulated forward pass on top of the connector's output, then vLLM's update."""
        ids = list(so.num_scheduled_tokens)
        if ids:  # the forward pass, simulated: every request past its prompt samples token 7
            # (a chunk that ends inside the prompt samples nothing, as vLLM's runner discards it)
            sampled = [[7] if self.sched.requests[r].num_computed_tokens
                       >= self.sched.requests[r].num_tokens else [] for r in ids]
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled, logprobs=None,
                                    prompt_logprobs_dict={}, pooler_output=None,
                                    kv_connector_output=out.kv_connector_output)
        eco = self.sched.update_from_output(so, out)
        for e in eco.values():
            if e.scheduler_stats is not None and e.scheduler_stats.kv_connector_stats:
                self.stats.append(e.scheduler_stats.kv_connector_stats)
        return so, eco

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.sched.connector.shutdown()


def request(rid: str, n: int, params: dict, max_tokens: int, first: int = 3) -> Request:
    """A request of prompt tokens first..first+n-1 (distinct `first`: no shared prefix)."""
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    r = Request(request_id=rid, prompt_token_ids=list(range(first, first + n)), sampling_params=sp,
                pooling_params=None, mm_features=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = params
    return r


def prefill(side: Side, rid: str, n: int, first: int = 3) -> tuple[dict, list[list[int]]]:
    """Run a prefill request to its end; its kv_transfer_params and its (held) blocks."""
    req = request(rid, n, {"do_remote_decode": True}, 1, first)
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


# -- TP > 1: the worker-side connectors in their own processes -------------------------------------
def tp_worker(conn, model_dir: str, rank: int, tp: int, init: str, roles: dict[str, dict]) -> None:
    """One TP rank's worker process: vLLM's TP group over gloo, a worker connector per role.

    What vLLM's multiproc executor does for the connector, minus the model:
    the distributed environment and TP group (so the connector asks
    `get_tp_group()` for its rank), the worker connector registering this
    rank's caches, and per step `kv_connector_no_forward` on the
    `SchedulerOutput` the scheduler broadcast; the results go back for vLLM's
    own `KVOutputAggregator`.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    sides = {role: Side(model_dir, role, worker_only=True, tp=tp, seed=kw.pop("seed") + rank, **kw)
             for role, kw in roles.items()}
    first = next(iter(sides.values()))
    with set_current_vllm_config(first.cfg):
        init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=init,
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
    for side in sides.values():
        side.start_worker()
    conn.send({role: s.worker.get_handshake_metadata() for role, s in sides.items()})
    while True:
        cmd, role, arg = conn.recv()
        if cmd == "close":
            for s in sides.values():
                s.worker.shutdown()
            conn.send(None)
            return
        side = sides[role]
        if cmd == "step":
            kv_transfer_state._KV_CONNECTOR_AGENT = side.worker
            conn.send(KVConnectorModelRunnerMixin.kv_connector_no_forward(arg, side.cfg))
        elif cmd == "bytes":
            layer, blocks = arg
            conn.send([t.clone() for t in block_bytes(side, layer, blocks)])


class TPSides:
    """A prefill and a decode at TP `tp`: two schedulers here, `tp` worker processes.

    Rank r's process holds rank r's prefill and decode worker connectors
    (two pdxfer engines; one TP group of `tp` processes serves both roles,
    where a deployment has one per engine).
    """

    def __init__(self, model_dir: str, tp: int = 2, **kw) -> None:
        import multiprocessing
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.tp = tp
        self.sides = {role: Side(model_dir, role, scheduler_only=True, tp=tp, **kw)
                      for role in ("kv_producer", "kv_consumer")}
        roles = {"kv_producer": {"seed": 100, **kw}, "kv_consumer": {"seed": 200, **kw}}
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(tp):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=tp_worker, args=(theirs, model_dir, rank, tp, init, roles),
                               daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        metas = [self._recv(c, 300.0) for c in self.conns]
        prefill = self.sides["kv_producer"].sched.connector
        prefill.set_xfer_handshake_metadata_pp_aware(
            {(0, r): m["kv_producer"] for r, m in enumerate(metas)})
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.aggregators = {role: KVOutputAggregator(tp) for role in self.sides}

    @staticmethod
    def _recv(conn, timeout: float = 60.0):
        assert conn.poll(timeout), f"a TP worker process did not answer in {timeout} s"
        return conn.recv()

    def step(self, role: str):
        """One step of `role`'s engine: schedule, every rank's connector turn, aggregate, update."""
        side = self.sides[role]
        so = side.sched.schedule()
        for c in self.conns:
            c.send(("step", role, so))
        out = self.aggregators[role].aggregate([self._recv(c) for c in self.conns])
        return side.finish_step(so, out)

    def bytes(self, role: str, rank: int, layer: str, blocks: list[int]) -> list[torch.Tensor]:
        self.conns[rank].send(("bytes", role, (layer, blocks)))
        return self._recv(self.conns[rank])

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            try:
                c.send(("close", None, None))
                self._recv(c, 30.0)
            finally:
                p.join(30.0)
                if p.is_alive():
                    p.kill()
