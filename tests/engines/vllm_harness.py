"""vLLM 0.33's scheduler and worker connector, stepped without a model: what the vLLM tests share.

Real (vLLM, imported): `VllmConfig`/`ModelConfig` (a local two-layer
config.json; nothing is downloaded), `KVConnectorFactory` loading
`PdxferConnector` by module path, the `Scheduler` (schedule /
update_from_output, its KV cache manager and block pool, prefix caching,
`WAITING_FOR_REMOTE_KVS`, delayed block freeing, the load-failure policy,
the stats it hands its loggers), `Request`, and the worker connector's
lifecycle through `KVConnectorModelRunnerMixin.kv_connector_no_forward`
(bind metadata, `start_load_kv`, `wait_for_save`, `get_transfer_results`,
`get_block_ids_with_load_errors`, `get_kv_connector_stats`), in worker
processes of its own per engine and TP rank (`Engine`; at TP > 1 with vLLM's
TP group over gloo), their outputs folded by vLLM's `KVOutputAggregator`.
pdxfer moves the bytes between the prefill's and the decode's worker
processes over tcp on 127.0.0.1.

Simulated: the forward pass (a hand-built `ModelRunnerOutput` sampling token
7), the KV tensors (CPU tensors in the attention backend's `[2, blocks,
block_size, heads, head_size]` shape, and for the hybrid case Mamba state
views sharing each block's page of one raw buffer, as vLLM's hybrid
allocator lays them out), the executor (`Engine`: a pipe per worker process
carrying the `SchedulerOutput` and its results, the workers' handshake
metadata handed to the scheduler), the GPU platform's leaving the hybrid KV cache manager on (the CPU
platform turns it off), and the proxy that copies `kv_transfer_params` from
the prefill's output into the decode's request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import vllm_forkserver
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
    """One vLLM engine's config and either its scheduler (`Engine`) or one worker's connector.

    `worker_only`: the worker process's part (`start_worker` registers its
    caches); else the scheduler's (with its scheduler-side connector).
    """

    def __init__(self, model_dir: str, role: str, *, hybrid: bool = False, head: int = HEAD,
                 timeout: float = 2.0, request_timeout: float | None = 2.0, seed: int = 0,
                 blocks: int = BLOCKS, max_seqs: int = 8, policy: str = "fail",
                 prefix_caching: bool | None = None, tp: int = 1, worker_only: bool = False,
                 extra: dict | None = None) -> None:
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
        self.stats: list[dict] = []  # the connector stats the scheduler handed its loggers
        self.scheduler_stats: list = []  # the SchedulerStats carrying them, for vLLM's loggers
        self.worker = None
        if not worker_only:
            self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kvc,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=BLOCK, log_stats=True)

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
                self.scheduler_stats.append(e.scheduler_stats)
        return so, eco

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def request(rid: str, n: int, params: dict, max_tokens: int, first: int = 3,
            tokens: list[int] | None = None) -> Request:
    """A request of prompt tokens first..first+n-1 (distinct `first`: no shared prefix), or `tokens`."""
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    prompt = list(tokens) if tokens is not None else list(range(first, first + n))
    r = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                pooling_params=None, mm_features=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = params
    return r


def prefill(side, rid: str, n: int, first: int = 3,
            tokens: list[int] | None = None) -> tuple[dict, list[list[int]]]:
    """Run a prefill request to its end (on an `Engine`); its kv_transfer_params and (held) blocks."""
    req = request(rid, n, {"do_remote_decode": True}, 1, first, tokens)
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


def block_bytes(side, layer: str, blocks: list[int]) -> list[torch.Tensor]:
    """The blocks' bytes per tensor (as int16: random bits make NaNs, and NaN != NaN).

    `side`: a `Side` holding its worker, or an `Engine` (then rank 0's, from its process).
    """
    if isinstance(side, Engine):
        return side.bytes(layer, blocks)
    cache = side.caches[layer]
    parts = cache if isinstance(cache, list) else [cache[0], cache[1]]
    return [t[blocks].contiguous().view(torch.int16) for t in parts]


# -- the worker-side connectors in their own processes ----------------------------------------------
_IMPORTED_BY = os.getpid()  # the fork server's pid in its workers: vllm_forkserver.preloaded


def worker_main(conn, model_dir: str, role: str, rank: int, tp: int, init: str, kw: dict) -> None:
    """One TP rank of one engine: its worker-side connector, as vLLM's worker process holds it.

    What vLLM's executor does for the connector, minus the model: at TP > 1 the
    distributed environment and TP group over gloo (the connector asks
    `get_tp_group()` for its rank), the worker connector registering this
    rank's caches, and per step `kv_connector_no_forward` on the
    `SchedulerOutput` the scheduler broadcast; the output goes back for vLLM's
    own `KVOutputAggregator`.
    """
    logged = _Logged()
    logging.getLogger("pdxfer.vllm").addHandler(logged)
    side = Side(model_dir, role, worker_only=True, tp=tp, **kw)
    side.logged = logged.lines
    if tp > 1:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        with set_current_vllm_config(side.cfg):
            init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=init,
                                         local_rank=rank, backend="gloo")
            initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
    side.start_worker()
    conn.send((side.worker.get_handshake_metadata(), vllm_forkserver.preloaded(_IMPORTED_BY)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "close":
            side.worker.shutdown()
            conn.send(None)
            return
        if cmd == "step":
            kv_transfer_state._KV_CONNECTOR_AGENT = side.worker
            conn.send(KVConnectorModelRunnerMixin.kv_connector_no_forward(arg, side.cfg))
        elif cmd == "bytes":
            conn.send([t.clone() for t in block_bytes(side, *arg)])
        elif cmd == "call":
            fn, args = arg
            conn.send(fn(side, *args))


class _Logged(logging.Handler):
    """Keeps the connector's warnings and errors in a worker process, for `logged`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class WorkerDied(RuntimeError):
    """A worker process of the engine is gone (what a test that kills one expects)."""


class Engine:
    """One vLLM engine: its real `Scheduler` here, each TP rank's worker connector in a process.

    `step()` is one engine step as vLLM's EngineCore runs it: schedule, the
    `SchedulerOutput` to every worker process, their outputs folded by vLLM's
    `KVOutputAggregator`, the simulated forward pass, `update_from_output`.
    The block ids the workers reported as failed loads (what the scheduler's
    load-failure policy is handed) are kept in `invalid`, step by step.
    """

    def __init__(self, model_dir: str, role: str, *, tp: int = 1, seed: int = 0, **kw) -> None:
        import socket

        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.role, self.tp = role, tp
        self.side = Side(model_dir, role, tp=tp, seed=seed, **kw)
        self.sched, self.cfg, self.stats = self.side.sched, self.side.cfg, self.side.stats
        self.invalid: list[set[int]] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = vllm_forkserver.context()
        self.conns, self.procs = [], []
        for rank in range(tp):  # rank r's caches seeded apart from every other rank's and engine's
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, daemon=True, args=(
                theirs, model_dir, role, rank, tp, init, {**kw, "seed": seed + 1000 * rank}))
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        metas, preloaded = zip(*[self._recv(r, 300.0) for r in range(tp)], strict=True)
        # a worker that imported vLLM itself costs a dozen seconds: the fork server's preload
        # failed (vllm_forkserver says why that happens silently)
        assert all(preloaded), f"{role}'s workers imported {vllm_forkserver.PRELOAD} themselves"
        if self.sched.connector._producer:  # what EngineCore does with the workers' metadata
            self.sched.connector.set_xfer_handshake_metadata_pp_aware(
                {(0, r): m for r, m in enumerate(metas)})
        self.aggregator = KVOutputAggregator(tp)

    def _recv(self, rank: int, timeout: float = 120.0):
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            if conn.poll(timeout):
                return conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"{self.role} rank {rank} (pid {proc.pid}) is gone") from exc
        if not proc.is_alive():
            raise WorkerDied(f"{self.role} rank {rank} (pid {proc.pid}) is gone")
        raise AssertionError(f"{self.role} rank {rank} did not answer in {timeout} s")

    def _ask(self, rank: int, cmd: str, arg):
        try:
            self.conns[rank].send((cmd, arg))
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"{self.role} rank {rank} is gone") from exc
        return self._recv(rank)

    def step(self):
        """One engine step (schedule, every worker's connector turn, aggregate, update)."""
        so = self.sched.schedule()
        for r in range(self.tp):
            try:
                self.conns[r].send(("step", so))
            except (BrokenPipeError, OSError) as exc:
                raise WorkerDied(f"{self.role} rank {r} is gone") from exc
        out = self.aggregator.aggregate([self._recv(r) for r in range(self.tp)])
        kvo = out.kv_connector_output if out is not None else None
        if kvo is not None and kvo.invalid_block_ids:
            self.invalid.append(set(kvo.invalid_block_ids))
        return self.side.finish_step(so, out)

    def bytes(self, layer: str, blocks: list[int], rank: int = 0) -> list[torch.Tensor]:
        """Rank `rank`'s bytes of `blocks` in `layer` (as `block_bytes`)."""
        return self._ask(rank, "bytes", (layer, blocks))

    def call(self, fn, *args, rank: int = 0):
        """`fn(side, *args)` in rank `rank`'s worker process (fn: a module-level function)."""
        return self._ask(rank, "call", (fn, args))

    def free_blocks(self) -> int:
        return self.side.free_blocks()

    def kill(self) -> None:
        """SIGKILL every worker process: the engine dies mid-whatever it was doing."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join(30.0)

    def close(self) -> None:
        for r, (c, p) in enumerate(zip(self.conns, self.procs, strict=True)):
            try:
                if p.is_alive():
                    self._ask(r, "close", None)
            except (WorkerDied, AssertionError):
                pass
            finally:
                p.join(30.0)
                if p.is_alive():
                    p.kill()
                c.close()
        self.sched.connector.shutdown()


# -- what tests run in a worker process (Engine.call) ----------------------------------------------
def send_state(side: Side, rid: str):
    """The prefill engine's state of `rid` (None: it knows nothing of it yet)."""
    return side.worker.prefill.try_poll(rid)


def prefill_address(side: Side) -> str:
    """The worker's prefill engine's bootstrap address."""
    return side.worker.prefill.bootstrap_address


def logged(side: Side) -> list[str]:
    """The connector's warnings and errors in this worker process so far."""
    return list(side.logged)


def waits(side: Side) -> tuple[float, float]:
    """The worker engine's (request wait, liveness timeout)."""
    return side.worker.config.request_wait, side.worker.config.timeout


def die_mid_transfer(side: Side) -> None:
    """Arm this prefill to die in its next transfer: half of it written, then SIGKILL.

    The first half of the first part's segments is written (no notify: the
    decode is never told it landed), and once that write completed the
    process kills itself, the rest never sent.
    """
    import os
    import signal
    import threading

    import pdxfer.prefill as prefill_module

    def dying(req, parts, last, conn, *_rest, **_kw) -> None:  # post_parts' signature, any tail
        region, remote, table = parts[0]
        half = conn.write(region, remote, table[: max(1, len(table) // 2)].copy())

        def kill() -> None:
            half.wait(30.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    prefill_module.post_parts = dying
