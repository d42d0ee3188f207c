"""pdxfer as a vLLM v1 KV connector: `PdxferConnector(KVConnectorBase_V1, SupportsHMA)`.

Load it by module path (no registration needed)::

    --kv-transfer-config '{"kv_connector": "PdxferConnector",
                           "kv_connector_module_path": "pdxfer.integrations.vllm",
                           "kv_role": "kv_producer"}'          # kv_consumer on decode

or by name, `"kv_connector": "PdxferConnector"` alone, once the
`vllm.general_plugins` entry point `register()` (declared in pdxfer's
pyproject) has put it in vLLM's connector factory.

pdxfer pushes (the prefill writes into the decode's blocks); vLLM's own
push-mode NIXL connector has the same shape, and this follows it:

- **Prefill (kv_producer).** When a request with `do_remote_decode` finishes,
  the scheduler-side `request_finished_all_groups` keeps its blocks
  (delay free) and returns `kv_transfer_params` naming the pdxfer addresses
  of the prefill's TP ranks (learned from the workers' handshake metadata)
  and the request id. The next step's metadata tells each worker to
  `PrefillEngine.send` those blocks; the engine holds the chunk until the
  decode's Expect arrives. The worker reports `finished_sending` once pdxfer
  says Success or Failed (no source byte is read any more), and only then
  does vLLM free the blocks. A decode that never comes fails the send after
  pdxfer's `request_timeout`, so held blocks are bounded in time.
- **Decode (kv_consumer).** A request carrying those params waits in
  `WAITING_FOR_REMOTE_KVS`: `get_num_new_matched_tokens` says the prompt
  arrives asynchronously, `update_state_after_alloc` records the allocated
  blocks, and the worker's `start_load_kv` calls `DecodeEngine.expect` with
  them (TP rank r expects from prefill rank r). `get_transfer_results`
  reports `finished_recving` on Success, and on Failed also `failed_recving`,
  so vLLM recomputes or fails the request by its load-failure policy. A
  request that may still be written (pdxfer's `Quarantined`) is not
  reported at all until it is safe (`kit.engine_poll`): vLLM frees or
  reuses the blocks the moment it hears the request finished.
- **Pools.** One pdxfer pool per KV cache group (`"g0"`, `"g1"`, ...), an
  entry being one block: the layers' caches vLLM registers, viewed block by
  block (`block_views`: K/V-first attention tensors split into K and V, a
  Mamba layer's state tensors sharing a page taken as that page). Both
  sides' pools are compared in pdxfer's handshake.
- **Hybrid models (HMA).** Block ids per group are clipped the way vLLM's own
  connectors do (`select_transfer_block_ids`; a Mamba group keeps only its
  running-state block), and with Mamba layers the prefill stops one token
  short and the decode recomputes it (a recurrent state cannot be rewound).

Configuration: `kv_connector_extra_config={"pdxfer": {EngineConfig fields}}`,
or `PDXFER_CONFIG`; the host defaults to vLLM's `get_ip()`. Not supported
(refused or skipped with the reason): sliding-window groups, different TP
sizes, pipeline parallelism, a decode-side prefix-cache hit on a remotely
prefilled request (the decode then computes the prompt itself and the
prefill's send times out).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pdxfer import layout

from ..config import KVPoll
from ..decode import DecodeEngine
from ..errors import ConfigError, PdxferError, UnknownRequestError
from ..prefill import PrefillEngine
from .kit import CONFIG_ENV, engine_config, engine_poll

try:  # the engine is optional: this module imports (and is unit-tested) without it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    _MISSING: ImportError | None = None
except ImportError as exc:  # noqa: F841 — kept for the message
    # Distinct stand-ins, so the classes below still define (and their pure parts test).
    KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})  # type: ignore[misc,assignment]
    SupportsHMA = type("SupportsHMA", (), {})  # type: ignore[misc,assignment]
    KVConnectorHandshakeMetadata = KVConnectorMetadata = object  # type: ignore[misc,assignment]
    KVConnectorRole = KVConnectorTransferResults = None  # type: ignore[assignment]
    _MISSING = exc

log = logging.getLogger("pdxfer.vllm")

NAME = "PdxferConnector"


def block_views(cache: Any, num_blocks: int) -> list[torch.Tensor]:
    """One layer's cache as block-major, contiguous tensors `[num_blocks, ...]`.

    `cache` is what vLLM registers for a layer: an attention tensor, K/V
    first (`[2, blocks, ...]`, split into K and V) or block first
    (`[blocks, ...]`), or a Mamba layer's state tensors. States that share one
    page per block (the hybrid allocator gives every group one page size) are
    strided views; the page they share is taken whole as `[blocks, page]`
    bytes, once. Anything else is refused with its shape and strides.
    """
    parts = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    out: list[torch.Tensor] = []
    strided: dict[tuple[int, int], list[torch.Tensor]] = {}
    for t in parts:
        if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks and t.shape[0] != num_blocks:
            pieces = [t[0], t[1]]
        elif t.dim() >= 1 and t.shape[0] == num_blocks:
            pieces = [t]
        else:
            raise ConfigError(f"a KV cache tensor of shape {list(t.shape)} has no block dimension "
                              f"of {num_blocks} blocks (first or second after K/V)")
        for p in pieces:
            if p.is_contiguous():
                out.append(p)
            else:
                strided.setdefault((p.untyped_storage().data_ptr(), p.stride(0) * p.element_size()),
                                   []).append(p)
    for (_, page), group in strided.items():
        base = min(p.data_ptr() for p in group)
        ends = [p.data_ptr() - base + p[0].numel() * p.element_size() for p in group]
        storage = group[0].untyped_storage()
        start = base - storage.data_ptr()
        if max(ends) > page or start + num_blocks * page > storage.nbytes():
            raise ConfigError(f"state tensors {[list(p.shape) for p in group]} with strides "
                              f"{[p.stride() for p in group]} do not share one page of {page} B per block")
        whole = torch.empty(0, dtype=torch.uint8, device=group[0].device).set_(
            storage, start, (num_blocks, page), (page, 1))
        out.append(whole)
    return out


def group_pools(kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]],
                num_blocks: int) -> dict[str, layout.PerLayerArena]:
    """One pool per cache group (`g0`, `g1`, ...): every layer's block views, fields by shape."""
    pools = {}
    for g, names in enumerate(groups):
        fields: dict[tuple, list[torch.Tensor]] = {}
        for name in names:
            if name not in kv_caches:
                raise ConfigError(f"cache group {g} names layer {name!r}, which the registered "
                                  f"caches lack (they have {sorted(kv_caches)[:8]}"
                                  f"{' ...' if len(kv_caches) > 8 else ''}); every group's layers "
                                  "must be among those handed to register_kv_caches")
            for v in block_views(kv_caches[name], num_blocks):
                fields.setdefault((tuple(v.shape[1:]), v.dtype), []).append(v)
        pools[f"g{g}"] = layout.PerLayerArena({f"f{j}": ts for j, ts in enumerate(fields.values())})
    return pools


@dataclasses.dataclass
class PdxferHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at start-up: its prefill engine's address."""

    address: str


class PdxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: requests to expect (decode) and to send (prefill)."""

    def __init__(self) -> None:
        self.recv: dict[str, tuple[str, list[str], list[list[int]]]] = {}  # id -> (pdxfer id, addrs, blocks)
        self.send: dict[str, list[list[int]]] = {}  # id -> blocks per group


def _require_vllm() -> None:
    if _MISSING is not None:
        raise ImportError(f"pdxfer's vLLM connector needs vLLM installed (pip install vllm): "
                          f"{_MISSING}") from _MISSING


class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    """pdxfer behind vLLM's KV connector API; one instance per role and process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        _require_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        ktc = vllm_config.kv_transfer_config
        self._producer, self._consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        par = vllm_config.parallel_config
        self._tp_size = int(par.tensor_parallel_size)
        if int(par.pipeline_parallel_size) != 1:
            raise ConfigError("PdxferConnector does not support pipeline parallelism; run with "
                              "pipeline_parallel_size=1")
        specs = [g.kv_cache_spec for g in kv_cache_config.transfer_groups]
        if any(isinstance(s, SlidingWindowSpec) for s in specs):
            raise ConfigError("PdxferConnector does not transfer sliding-window cache groups yet")
        self._ssm_spec = [s.num_speculative_blocks if isinstance(s, MambaSpec) else None for s in specs]
        self._clip = clip_ssm_state_blocks
        # Mamba: the prefill stops one token short, the decode recomputes it (h(N-1) -> h(N)).
        self._backoff = 1 if kv_cache_config.has_mamba_layers else 0
        given = ktc.get_from_extra_config("pdxfer", None)
        text = json.dumps(given) if given is not None else os.environ.get(CONFIG_ENV)
        from vllm.utils.network_utils import get_ip
        self.config = engine_config(text, host=get_ip)
        # scheduler side
        self._to_recv: dict[str, tuple[str, list[str], list[list[int]]]] = {}
        self._to_send: dict[str, list[list[int]]] = {}
        self._held: set[str] = set()  # prefill requests whose blocks wait for finished_sending
        self._addresses: list[str] = []
        # worker side
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        self._recving: dict[str, str] = {}  # vLLM id -> pdxfer id
        self._sending: set[str] = set()
        self._failed: set[str] = set()

    # ==== scheduler side =========================================================
    def _transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Block ids per transfer group, clipped as vLLM's connectors clip them."""
        chosen = self._kv_cache_config.select_transfer_block_ids(list(block_ids))
        return [list(self._clip(list(b), n)) if n is not None and b else list(b)
                for b, n in zip(chosen, self._ssm_spec, strict=True)]

    def on_new_request(self, request: Any) -> None:
        """Prefill side, Mamba models: compute all but the last prompt token (the decode does it)."""
        p = request.kv_transfer_params
        if (self._backoff and p and p.get("do_remote_decode") and not p.get("_pdxfer_truncated")
                and request.prompt_token_ids is not None and request.num_prompt_tokens > self._backoff):
            del request.prompt_token_ids[-self._backoff:]
            del request._all_token_ids[-self._backoff:]
            request.num_prompt_tokens -= self._backoff
            request.max_tokens = 1
            p["_pdxfer_truncated"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the prompt (less the recomputed tail) arrives asynchronously from the prefill."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return 0, False
        if num_computed_tokens:
            log.warning("pdxfer: request %s has %d tokens cached locally; pdxfer ships whole "
                        "prompts, so the decode computes it itself", request.request_id,
                        num_computed_tokens)
            return 0, False
        n = request.num_prompt_tokens - (self._backoff if request.num_prompt_tokens > self._backoff else 0)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: remember the blocks the prefill will write; once per request."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        addrs = list(p.get("remote_addresses") or [])
        self._to_recv[request.request_id] = (str(p["remote_request_id"]), addrs,
                                             self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups()))

    def build_connector_meta(self, scheduler_output: Any) -> PdxferConnectorMetadata:
        """This step's expects and sends, handed to every worker."""
        meta = PdxferConnectorMetadata()
        meta.recv, meta.send = self._to_recv, self._to_send
        self._to_recv, self._to_send = {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Single-group models: as `request_finished_all_groups`."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict | None]:
        """Prefill: hold a finished request's blocks for the push; params for the decode request."""
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):  # a decode request that ended before its blocks came
            p["do_remote_prefill"] = False
            return False, None
        if not p.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = self._transfer_blocks(block_ids)
        if not any(blocks):
            return False, None
        if len(self._addresses) != self._tp_size:
            log.error("pdxfer: no prefill addresses from the workers (got %d of %d); request %s "
                      "cannot be handed off", len(self._addresses), self._tp_size, request.request_id)
            return False, None
        self._to_send[request.request_id] = blocks
        self._held.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_request_id": request.request_id,
                      "remote_addresses": list(self._addresses), "tp_size": self._tp_size,
                      "remote_num_tokens": request.num_computed_tokens, "transfer_mode": "push"}

    def update_connector_output(self, connector_output: Any) -> None:
        """A finished send frees its blocks (vLLM does); stop holding the engine loop for it."""
        for rid in connector_output.finished_sending or ():
            self._held.discard(rid)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while a finished prefill request's blocks wait for its decode."""
        return bool(self._held or self._to_send)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' prefill addresses, in TP rank order."""
        self._addresses = [metadata[r].address for r in sorted(metadata)]

    # ==== worker side ============================================================
    def _tp_rank(self) -> int:
        if self._tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tp_group
        return int(get_tp_group().rank_in_group)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Adopt the layers' caches as one pool per group and start the engine(s) over them."""
        groups = [g.layer_names for g in self._kv_cache_config.transfer_groups]
        pools = group_pools(kv_caches, groups, int(self._kv_cache_config.num_blocks))
        if self._producer:
            self.prefill = PrefillEngine(pools, self.config)
        if self._consumer:
            self.decode = DecodeEngine(pools, self.config)

    def get_handshake_metadata(self) -> PdxferHandshake | None:
        """This worker's prefill address, for the scheduler's `kv_transfer_params`."""
        return PdxferHandshake(self.prefill.bootstrap_address) if self.prefill is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Expect this step's remote prefills; send this step's finished prefills."""
        meta = self._get_connector_metadata()
        rank = self._tp_rank()
        for rid, (pid, addrs, blocks) in meta.recv.items():
            self._recving[rid] = pid
            try:
                if self.decode is None:
                    raise ConfigError("this worker has no decode engine (kv_role is not a consumer)")
                if len(addrs) != self._tp_size:
                    raise ConfigError(f"the prefill runs {len(addrs)} TP ranks, this decode "
                                      f"{self._tp_size}; PdxferConnector pairs rank r with rank r")
                self.decode.expect(pid, addrs[rank], {f"g{g}": b for g, b in enumerate(blocks) if b})
            except PdxferError as exc:
                log.error("pdxfer: request %s cannot be received: %s", rid, exc)
                self._failed.add(rid)
        for rid, blocks in meta.send.items():
            self._sending.add(rid)
            try:
                if self.prefill is None:
                    raise ConfigError("this worker has no prefill engine (kv_role is not a producer)")
                self.prefill.send(rid, {f"g{g}": b for g, b in enumerate(blocks) if b}, last=True)
            except PdxferError as exc:
                log.error("pdxfer: request %s cannot be sent: %s", rid, exc)
                self._failed.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The prefill pushes finished requests whole (start_load_kv); nothing per layer."""

    def wait_for_save(self) -> None:
        """Sends are asynchronous; their blocks stay held until `finished_sending`."""

    def _finished(self, engine: Any, pid: str, rid: str) -> KVPoll | None:
        """The request's final state once it is safe to report (released then), else None."""
        if rid in self._failed:
            self._failed.discard(rid)
            try:
                engine.release(pid)
            except (PdxferError, AttributeError):
                pass
            return KVPoll.Failed
        state = engine_poll(engine.try_poll(pid))
        if not state.finished:
            return None
        try:
            engine.release(pid)
        except UnknownRequestError:
            pass
        return state

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Sends and receives that finished (Success or Failed), failed receives named."""
        out = KVConnectorTransferResults()
        for rid in list(self._sending):
            state = self._finished(self.prefill, rid, rid)
            if state is not None:
                self._sending.discard(rid)
                out.finished_sending.add(rid)
                if state is KVPoll.Failed:
                    log.warning("pdxfer: send of %s failed: %s", rid, self._reason(self.prefill, rid))
        for rid, pid in list(self._recving.items()):
            state = self._finished(self.decode, pid, rid)
            if state is not None:
                del self._recving[rid]
                out.finished_recving.add(rid)
                if state is KVPoll.Failed:
                    out.failed_recving.add(rid)
        return out

    @staticmethod
    def _reason(engine: Any, rid: str) -> str:
        try:
            return engine.failure_reason(rid) or "released"
        except PdxferError:
            return "released"

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """`get_transfer_results` for callers of the older two-set API."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def shutdown(self) -> None:
        """Close the engines; idempotent."""
        for engine in (self.prefill, self.decode):
            if engine is not None:
                engine.close()


def register() -> None:
    """`vllm.general_plugins` entry point: `"kv_connector": "PdxferConnector"` by name."""
    _require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, __name__, NAME)
    except ValueError:  # "already registered": plugins loaded a second time in this process
        pass
