"""SGLang's own disaggregation code, set up the way its scheduler sets it up, minus the model.

What the SGLang tests' two processes share. Real (SGLang 0.5.23, imported):
plugin loading (`load_plugins` runs pdxfer's entry point) and flag parsing
(`prepare_server_args`), the runtime context a scheduler process publishes,
the CPU KV pools (`MHATokenToKVPool`, `MLATokenToKVPool`, `HybridLinearKVPool` over a real
`MambaPool`), `MetadataBuffers` and its allocator, `Req`, the queues'
`_init_kv_manager` (so `KVArgs`, `setup_state_kv_args` and the manager
construction are SGLang's), `PrefillBootstrapQueue`, the prefill mixin's
`_send_kv_chunk` / `process_disagg_prefill_inflight_queue`,
`DecodePreallocQueue`, `DecodeTransferQueue`, the poll all-reduce over a
gloo group, and SGLang's bootstrap server (`PdxferKVBootstrapServer`).

Simulated (as SGLang's own CPU tests do): the scheduler object (a
`SimpleNamespace` with the attributes the queue methods read), the forward
pass (pool bytes are seeded random, `output_ids` set by hand), token
allocation (fixed page lists instead of `_pre_alloc`), and the tree cache
(`release_kv_cache` patched, a mock `tree_cache`).
"""

from __future__ import annotations

import functools
import os
import tempfile
import zlib
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import sglang_cpu_shim  # noqa: F401  (before anything imports torchvision)
import torch
import torch.distributed as dist
from sglang.srt.disaggregation import decode as D
from sglang.srt.disaggregation import prefill as P
from sglang.srt.disaggregation import utils as U
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import prepare_server_args

PAGE, LAYERS, HEADS, DIM = 16, 4, 2, 32
# 96 pages, 80 request rows and metadata rows: room for the 64-room queue test.
SIZE, SLOTS, META_ROWS, ROWS = 96 * PAGE, 8, 80, 80
FULL_LAYERS = [0, 2]  # the hybrid model's attention layers; 1 and 3 are Mamba
KV_LORA_RANK, ROPE_DIM = 64, 16  # the MLA model's latent cache: one [tokens, 1, 80] buffer a layer


def start(mode: str, bootstrap_port: int, tp: int = 1, *, rank: int = 0, world: int = 1,
          init_file: str | None = None, extra: tuple[str, ...] = ()) -> object:
    """What a scheduler process does first: plugins, flags, context, a gloo group.

    `world` > 1 joins `world` processes (this one is `rank`) through `init_file`:
    the TP group SGLang's queues all-reduce their polls over, for real.
    """
    load_plugins()
    server_args = prepare_server_args([
        "--model-path", "dummy", "--device", "cpu", "--tp-size", str(tp),
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "pdxfer",
        "--disaggregation-bootstrap-port", str(bootstrap_port), "--host", "127.0.0.1", *extra])
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file or tempfile.mktemp()}",
                                rank=rank, world_size=world)
    return server_args


def as_rank(rank: int, dp_rank: int | None = None) -> None:
    """Be TP rank `rank` (of DP rank `dp_rank`) from now on (one process plays each in turn)."""
    extra = {} if dp_rank is None else {"dp_rank": dp_rank}
    get_parallel().override_permanently(tp_rank=rank, attn_tp_rank=rank, **extra)


def kv_pool(hybrid: bool, dim: int = DIM, seed: int = 0, mla: bool = False):
    """A real CPU KV pool, seeded: MHA, MHA layers plus a Mamba pool, or MLA."""
    if mla:
        pool = MLATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.bfloat16,
                                kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    elif hybrid:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=128, n_groups=1,
                                        num_heads=4, head_dim=32, state_size=16, conv_kernel=4)
        mamba = MambaPool(size=SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(
            shape=shape, layers=[1, 3]), mamba_layer_ids=[1, 3], device="cpu")
        pool = HybridLinearKVPool(size=SIZE, dtype=torch.bfloat16, page_size=PAGE, head_num=HEADS,
                                  head_dim=dim, full_attention_layer_ids=FULL_LAYERS,
                                  device="cpu", mamba_pool=mamba)
    else:
        pool = MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                                head_dim=dim, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)
    gen = torch.Generator().manual_seed(seed)
    for t in buffers(pool):
        t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
    return pool


def kv_buffers(pool) -> list[torch.Tensor]:
    """The pool's paged tensors: K and V per attention layer, or MLA's latent cache per layer."""
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
    kv = pool.full_kv_pool if isinstance(pool, HybridLinearKVPool) else pool
    return list(kv.k_buffer) + list(kv.v_buffer)


def buffers(pool) -> list[torch.Tensor]:
    """Every tensor of the pool a transfer writes: K and V per layer, then Mamba states."""
    out = kv_buffers(pool)
    if isinstance(pool, HybridLinearKVPool):
        cache = pool.mamba_pool.mamba_cache
        out += [cache.conv[0], cache.temporal]  # [layers, slots, ...] each
    return out


def page_crc(pool, pages: list[int], slot: int | None) -> int:
    """crc32 of the pages of every K/V layer, then of the Mamba slot of every state tensor."""
    crc, idx = 0, torch.as_tensor(pages)
    for t in kv_buffers(pool):
        crc = zlib.crc32(t.view(-1, PAGE, *t.shape[1:])[idx].contiguous().view(torch.uint8).numpy(), crc)
    if slot is not None:
        cache = pool.mamba_pool.mamba_cache
        for t in (cache.conv[0], cache.temporal):
            crc = zlib.crc32(t[:, slot].contiguous().view(torch.uint8).numpy(), crc)
    return crc


def metadata() -> tuple[U.MetadataBuffers, U.ReqToMetadataIdxAllocator]:
    return (U.MetadataBuffers(size=META_ROWS, hidden_size=64, hidden_states_dtype=torch.float16,
                              max_sampling_mask_tokens=16),
            U.ReqToMetadataIdxAllocator(META_ROWS))


def _model(hybrid: bool) -> SimpleNamespace:
    text = SimpleNamespace(full_attention_layer_ids=FULL_LAYERS)
    return SimpleNamespace(num_hidden_layers=LAYERS, hf_text_config=text,
                           get_total_num_kv_heads=lambda: HEADS * get_parallel().attn_tp_size)


def token_pool(hybrid: bool) -> SimpleNamespace:
    """The request -> token slots map (allocation is simulated; the tests fill it)."""
    table = torch.zeros(ROWS, 1024, dtype=torch.int32)
    mamba = torch.arange(ROWS, dtype=torch.int64) % SLOTS  # row r holds Mamba slot r (r < SLOTS)
    return SimpleNamespace(req_to_token=table, req_index_to_mamba_index_mapping=mamba,
                           translate_mamba_indices=lambda x: x, available_size=lambda: ROWS)


class Prefill:
    """One prefill rank: SGLang's bootstrap queue and inflight queue over a pdxfer manager."""

    def __init__(self, server_args, hybrid: bool, seed: int, mla: bool = False) -> None:
        self.pool, (self.mb, self.alloc) = kv_pool(hybrid, seed=seed, mla=mla), metadata()
        self.hybrid, self.tokens = hybrid, token_pool(hybrid)
        G = dist.group.WORLD
        self.sched = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE,
                                                       translate_kv_indices_for_transfer=lambda x: x),
            req_to_token_pool=self.tokens, enable_staging=False, kv_checksum_computer=None,
            disagg_metadata_buffers=self.mb, disagg_prefill_pending_chunk_rids=set(),
            attn_cp_cpu_group=G, attn_tp_cpu_group=G, processed_tokens_counter=0,
            tree_cache=MagicMock(), output_streamer=MagicMock(), server_args=server_args,
            metrics_reporter=SimpleNamespace(enable_metrics=False), rust_server=None,
            req_to_metadata_buffer_idx_allocator=self.alloc, disagg_prefill_inflight_queue=[],
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")),
            model_config=_model(hybrid), scheduler_stage_metrics=None, batch_result_processor=MagicMock())
        q = P.PrefillBootstrapQueue.__new__(P.PrefillBootstrapQueue)
        q.__dict__.update(queue=[], pp_size=1, tp_rank=get_parallel().attn_tp_rank, pp_rank=0,
                          scheduler=self.sched, transfer_backend=U.TransferBackend("pdxfer"),
                          bootstrap_port=server_args.disaggregation_bootstrap_port,
                          token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                          is_mla_backend=U.is_mla_backend(self.pool), metadata_buffers=self.mb,
                          max_input_len=4096,
                          scheduler_stage_metrics=None, req_to_metadata_buffer_idx_allocator=self.alloc,
                          pp_poll_sync_work_list=[])
        q.kv_manager = q._init_kv_manager()  # real: KVArgs, state components, our manager
        self.queue = q
        self.sched.disagg_prefill_bootstrap_queue = q
        # The scheduler's own methods the queue code calls back into: SGLang's, bound to it.
        mixin = P.SchedulerDisaggregationPrefillMixin
        for name in ("handle_bootstrap_failure", "handle_inflight_transfer_failure",
                     "handle_pending_bootstrap", "send_kv_chunk", "clear_pending_chunk_send"):
            setattr(self.sched, name, functools.partial(getattr(mixin, name), self.sched))
        self.sched._release_aborted_request = MagicMock()  # the tree cache's part: simulated

    def send_chunk(self, req: Req, end: int, last: bool) -> None:
        """The mixin's `_send_kv_chunk` after a forward that computed up to token `end`."""
        req.extend_end = end
        if last:
            self.sched.disagg_prefill_inflight_queue.append(req)
        with patch.object(P, "get_schedule", lambda: SimpleNamespace(chunked_prefill_size=-1)):
            P.SchedulerDisaggregationPrefillMixin._send_kv_chunk(self.sched, req, last_chunk=last)

    def inflight(self) -> list[Req]:
        """One turn of `process_disagg_prefill_inflight_queue` (the tree cache simulated)."""
        with patch.object(P, "release_kv_cache", MagicMock()):
            return P.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue(self.sched)


class Decode:
    """One decode rank: SGLang's prealloc queue and transfer queue over a pdxfer manager."""

    def __init__(self, server_args, hybrid: bool, dim: int = DIM, mla: bool = False) -> None:
        self.pool, (self.mb, self.alloc) = kv_pool(hybrid, dim=dim, seed=99, mla=mla), metadata()
        self.hybrid, self.tokens = hybrid, token_pool(hybrid)
        G = dist.group.WORLD
        self.sched = SimpleNamespace(
            enable_decode_hicache=False, kv_checksum_computer=None, output_streamer=MagicMock(),
            metrics_reporter=SimpleNamespace(enable_metrics=False), disagg_decode_prealloc_queue=None,
            batch_result_processor=MagicMock(), spec_algorithm=SimpleNamespace(is_none=lambda: True),
            enable_hisparse=False, server_args=server_args, model_config=_model(hybrid),
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")))
        pq = D.DecodePreallocQueue.__new__(D.DecodePreallocQueue)
        pq.__dict__.update(queue=[], pending_reqs=[], retracted_queue=[], pp_size=1, pp_rank=0,
                           tp_rank=get_parallel().attn_tp_rank, gloo_group=G, scheduler=self.sched,
                           transfer_backend=U.TransferBackend("pdxfer"), _prefill_dp_rank_queries={},
                           _ensure_last_attempt_time={}, _ensure_retry_count={},
                           _ensure_retry_interval=0.0, _max_ensure_retries=1000,
                           _num_published_destinations=0, req_to_metadata_buffer_idx_allocator=self.alloc,
                           token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                           metadata_buffers=self.mb, is_mla_backend=U.is_mla_backend(self.pool),
                           enable_staging=False,
                           req_to_token_pool=self.tokens, tree_cache=MagicMock(),
                           transfer_queue=SimpleNamespace(enable_staging=False))
        pq._check_if_req_exceed_kv_capacity = lambda req: False  # reads the token pools: simulated
        pq.kv_manager = pq._init_kv_manager()
        tq = D.DecodeTransferQueue.__new__(D.DecodeTransferQueue)
        tq.__dict__.update(queue=[], gloo_group=G, tp_rank=pq.tp_rank, metadata_buffers=self.mb,
                           scheduler=self.sched, req_to_metadata_buffer_idx_allocator=self.alloc,
                           enable_staging=False, staging_handler=None,
                           # SGLang's own settings (deferred release on by default, 30 s hold)
                           enable_deferred_kv_release=envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get(),
                           deferred_kv_release_timeout=envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get(),
                           _deferred_releases=[], spec_algorithm=self.sched.spec_algorithm,
                           _skipped_checksum_signatures=set(), enable_host_receive=False,
                           tree_cache=MagicMock())
        self.prealloc, self.transfer = pq, tq

    def admit(self, req: Req):
        """`add` -> resolve the prefill rank -> handshake waiters: the request waits for pages."""
        pq = self.prealloc
        pq.add(req)
        pq._resolve_pending_reqs()
        pq._update_handshake_waiters()
        return next(d for d in pq.queue if d.req is req)

    def allocate(self, dreq, pages: list[int], slot: int | None, prefix_pages: int = 0) -> None:
        """Allocation simulated (fixed pages, Mamba slot), then the real `_send_kv_metadata`.

        `prefix_pages`: a decode radix-cache hit on the prompt's first pages;
        `pages` are then the tail's, as `_pre_alloc` allocates them.
        """
        n = len(dreq.req.origin_input_ids) - prefix_pages * PAGE
        tokens = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])[:n]
        states = [[self.tokens.req_index_to_mamba_index_mapping[slot].reshape(1).numpy()]] if self.hybrid else None
        self.prealloc._send_kv_metadata(dreq, tokens, PAGE, states,
                                        decode_prefix_len=prefix_pages * PAGE)
        self.prealloc.queue.remove(dreq)
        self.transfer.queue.append(dreq)

    def transferred(self, on_release=None):
        """One turn of `pop_transferred` and of `resolve_deferred_releases` (the tree cache
        simulated); the patched release mock too, calling `on_release(req)` when SGLang frees."""
        release = MagicMock(side_effect=(lambda req, *a, **k: on_release(req)) if on_release else None)
        with patch.object(D, "release_kv_cache", release):
            out = self.transfer.pop_transferred()
            self.transfer.resolve_deferred_releases()
            return out, release

    def busy(self) -> bool:
        """Requests still in the transfer queue or held by SGLang's deferred release."""
        return bool(self.transfer.queue) or self.transfer.has_pending_deferred_releases()


def request(room: int, n: int, port: int, host: str = "127.0.0.1") -> Req:
    """A real `Req` as the router hands it over (bootstrap host, port, room)."""
    r = Req(rid=f"r{room}", origin_input_text="", origin_input_ids=list(range(5, 5 + n)),
            sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host=host,
            bootstrap_port=port, bootstrap_room=room)
    r.time_stats = MagicMock()
    return r


def pdxfer_env(**config) -> None:
    """This process's pdxfer engine config, as a deployment sets it (`PDXFER_CONFIG`)."""
    import json
    os.environ["PDXFER_CONFIG"] = json.dumps({"transport": "tcp", "host": "127.0.0.1", **config})
