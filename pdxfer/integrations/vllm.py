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
or `PDXFER_CONFIG`; the host defaults to vLLM's `get_ip()`, and the
per-request wait (`request_timeout`) to `SERVING_REQUEST_TIMEOUT` (300 s,
SGLang's and NIXL's order of size: a decode request can sit minutes in D's
waiting queue under load) while the liveness bound (`timeout`, 10 s) stays
short, so a dead peer still fails its requests in seconds. A decode request
queued (added, not yet allocated) is kept alive on its prefill meanwhile
(`DecodeEngine.hold`: pdxfer's Renew, from `on_new_request` until its
Expect), so `request_timeout` bounds a silent decode, not a long queue.

- **Aborts.** A decode request vLLM finishes while its KV is loading (an
  abort in `WAITING_FOR_REMOTE_KVS`) arrives in `finished_req_ids`; the
  worker aborts its pdxfer request at once, which tells the prefill (its
  send fails, its blocks are freed), and reports it finished once no byte
  can land.
- **Load failures.** A failed receive is reported as the blocks it was
  loading (`get_block_ids_with_load_errors`; after a local prefix hit the
  tail's only: the cached prefix is still good) for a single-group model, so
  `kv_load_failure_policy=recompute` recomputes those blocks and no others;
  a hybrid model's (block ids are not unique across groups there, and vLLM
  refuses them) as `failed_recving`, which recomputes the request.
- **Identity.** Each pool field's name carries the model, dtype, cache
  dtype, attention backend(s) and KV cache layout, so a pair that differs in
  any of them is refused by pdxfer's handshake naming both values, before a
  byte is written; `get_required_kvcache_layout` asks for LBNHC (vLLM's
  default) so two backends that would pick different layouts agree.
- **Metrics.** `get_kv_connector_stats` / `build_kv_connector_stats` /
  `build_prom_metrics`: per transfer (one per TP rank, as vLLM aggregates
  its workers' stats) bytes, segments, pdxfer's elapsed time and wire time,
  failures by cause, quarantines and their duration, and the decode's
  prefix-cache fallbacks (below); `vllm:pdxfer_*` series.
- **The plugin edge.** `register()` never raises (vLLM calls plugins
  unguarded: one raise stops every vLLM process); it logs one warning.
  Constructing the connector without vLLM, or with a vLLM whose names moved,
  raises an `ImportError` saying which (the name, the vLLM version).

Not supported (refused or reported with the reason): sliding-window groups,
different TP sizes (refused by name: each decode request fails with "the
prefill runs N TP ranks, this decode M"; its prefill's send waits out its
`request_timeout`), pipeline parallelism, sleep mode (`supports_sleep_mode`
is False: registered memory is not re-registered), and prefix caching on
the decode of a hybrid (Mamba) model (refused at start-up: a local hit
cannot resume the Mamba state the prefill sends). Should a hybrid decode
see a local hit anyway, it computes the prompt itself, warns once per
request and counts it (`vllm:pdxfer_num_prefix_cache_fallbacks`). Any other
model's decode prefix hit loads only the uncached tail (`cached_blocks`,
the engine's tail-only Expect), as NIXL does since vllm-project/vllm#48758.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pdxfer import layout

from ..config import KVPoll
from ..decode import DecodeEngine
from ..errors import ConfigError, PdxferError, UnknownRequestError
from ..prefill import PrefillEngine
from .kit import CONFIG_ENV, engine_config, engine_poll
from .layer_stream import LayerStream

#: The vLLM release this connector is written and tested against (tests/engines/vllm-pins.txt).
BUILT_FOR = "0.33"

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

try:  # metrics are optional even with vLLM: without them the connector only reports no stats
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    _NO_METRICS: ImportError | None = None
except ImportError as exc:  # noqa: F841
    KVConnectorStats = type("KVConnectorStats", (), {})  # type: ignore[misc,assignment]
    KVConnectorPromMetrics = type("KVConnectorPromMetrics", (), {})  # type: ignore[misc,assignment]
    _NO_METRICS = exc

log = logging.getLogger("pdxfer.vllm")

NAME = "PdxferConnector"

#: The connector's per-request wait unless the config sets `request_timeout`: serving-sized,
#: as a decode request can wait minutes in D's queue under load (SGLang and NIXL: 300 s).
SERVING_REQUEST_TIMEOUT = 300.0


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
                num_blocks: int, identity: str = "") -> dict[str, layout.PerLayerArena]:
    """One pool per cache group (`g0`, `g1`, ...): every layer's block views, fields by shape.

    `identity` (what `engine_identity` returns) is part of every field's
    name, so two engines whose identities differ have pools that pdxfer's
    handshake refuses, the refusal naming both names.
    """
    suffix = f" [{identity}]" if identity else ""
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
        pools[f"g{g}"] = layout.PerLayerArena({f"f{j}{suffix}": ts
                                               for j, ts in enumerate(fields.values())})
    return pools


def engine_identity(vllm_config: Any, backends: Sequence[str]) -> str:
    """What two engines must share beyond field shapes, as one readable string.

    The factors vLLM's NIXL connector hashes for the same purpose that decide
    what the bytes of a block mean: the model, its dtype, the cache dtype,
    the attention backend(s) and the KV cache layout. Shapes and dtypes of
    the fields are compared by the handshake already; TP size and rank are
    not here (the address list pairs ranks, and a TP mismatch is refused by
    name before any Expect).
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    model = getattr(mc, "model", None) if mc is not None else None
    dtype = str(getattr(mc, "dtype", None)).removeprefix("torch.") if mc is not None else None
    kv_layout = getattr(cc, "kv_cache_layout", None) or PdxferConnector.get_required_kvcache_layout(
        vllm_config) or "default"
    return (f"model={model} dtype={dtype} cache_dtype={getattr(cc, 'cache_dtype', None)} "
            f"backend={'+'.join(sorted(backends)) or 'unknown'} layout={kv_layout}")


def _attention_backends(vllm_config: Any, layer_names: Sequence[str]) -> list[str]:
    """Names of the attention backends of `layer_names` (vLLM's own lookup; [] if it cannot tell)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return sorted({b.get_name() for b in get_current_attn_backends(vllm_config, list(layer_names))})
    except Exception as exc:  # vLLM's lookup may need a platform this process lacks
        log.warning("pdxfer: could not tell the attention backend (%s: %s); the identity pdxfer's "
                    "handshake compares names it 'unknown'", type(exc).__name__, exc)
        return []


# ==== the plugin edge: what is missing, said precisely ====================================
def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing_name(exc: ImportError) -> str:
    """The dotted name an ImportError is about: a moved module, or a name gone from one."""
    found = re.search(r"cannot import name '([^']+)' from '([^']+)'", str(exc))
    if found:
        return f"{found.group(2)}.{found.group(1)}"
    return exc.name or str(exc)


def explain_import_error(exc: ImportError) -> str:
    """Why the connector cannot run here: vLLM is not installed, or a name it needs moved.

    The two call for different fixes (install vLLM; pin the vLLM this
    pdxfer was built for, or upgrade pdxfer), so they read differently.
    """
    try:
        installed = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a half-imported or stubbed-out vllm module
        installed = False
    version = _vllm_version()
    if not installed:
        return (f"pdxfer's vLLM connector needs vLLM installed (pip install 'vllm=={BUILT_FOR}.*'): "
                f"{exc}")
    return (f"vLLM {version or '(unknown version)'} is installed, but {_missing_name(exc)!r}, which "
            f"pdxfer's connector needs, is not there ({exc}); this pdxfer is built for vLLM "
            f"{BUILT_FOR}: install vllm=={BUILT_FOR}.* or a pdxfer release for vLLM {version}")


def _from_vllm(module: str, *names: str) -> Any:
    """`from module import names` (a tuple for several), an ImportError naming what moved otherwise."""
    try:
        mod = importlib.import_module(module)
        got = tuple(getattr(mod, n) for n in names)
    except ImportError as exc:
        raise ImportError(explain_import_error(exc)) from exc
    except AttributeError as exc:
        gone = ImportError(f"cannot import name '{exc.name}' from '{module}'", name=module)
        raise ImportError(explain_import_error(gone)) from exc
    return got if len(got) > 1 else got[0]


def _require_vllm() -> None:
    if _MISSING is not None:
        raise ImportError(explain_import_error(_MISSING)) from _MISSING


@dataclasses.dataclass
class PdxferHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at start-up: its prefill engine's address."""

    address: str


class PdxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: requests to expect (decode) and to send (prefill)."""

    def __init__(self) -> None:
        # id -> (pdxfer id, addrs, tail blocks per group, cached blocks per group)
        self.recv: dict[str, tuple[str, list[str], list[list[int]], list[int]]] = {}
        self.send: dict[str, list[list[int]]] = {}  # id -> blocks per group
        self.stream: dict[str, list[list[int]]] = {}  # id -> blocks, streamed by layer groups
        self.abort: list[str] = []  # streamed ids vLLM ended before handing them off
        self.hold: dict[str, list[str]] = {}  # pdxfer id -> prefill addresses: keep alive
        self.unhold: set[str] = set()  # pdxfer ids no longer queued here (ended unexpected)


# ==== metrics ===============================================================================
def cached_blocks(num_computed_tokens: int, block_sizes: Sequence[int],
                  ssm_spec: Sequence[Any]) -> list[int] | None:
    """Per transfer group, how many leading blocks of the prompt the decode's prefix cache holds.

    vLLM's local hits are whole blocks of every group (`num_computed_tokens`
    is a multiple of each block size): the decode loads only the blocks after
    them (vllm-project/vllm#48758 does so for NIXL). None when the hit cannot
    be resumed from the prefill's blocks: a Mamba group's one state block is
    the state after the whole prompt, not after the prefix.
    """
    if not num_computed_tokens:
        return [0] * len(block_sizes)
    if any(s is not None for s in ssm_spec):
        return None
    return [num_computed_tokens // bs for bs in block_sizes]


def tail_expect(blocks: Sequence[Sequence[int]], cached: Sequence[int]
                ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The decode's `expect(indices, offsets=)` for tail blocks per group after `cached` held ones.

    A group whose whole prompt is cached is named with no blocks (its offset
    still tells the prefill to skip them); one with nothing is left out.
    """
    indices = {f"g{g}": list(b) for g, (b, k) in enumerate(zip(blocks, cached, strict=True)) if b or k}
    return indices, {f"g{g}": k for g, k in enumerate(cached) if k}


def failure_kind(cause: BaseException | None, reason: str | None) -> str:
    """A failure's label: the exception class pdxfer attached, or 'aborted' / 'unknown'."""
    if cause is not None:
        return type(cause).__name__
    return "aborted" if reason and "aborted" in reason else "unknown"


_STAT_KEYS = ("transfer_s", "wire_s", "bytes", "segments", "failed", "quarantine_s",
              "prefix_fallbacks")


class PdxferKVConnectorStats(KVConnectorStats):
    """One interval's observations, as vLLM's stats pipeline carries them (`data`, serializable).

    One observation per finished pdxfer request per worker: at TP n a vLLM
    request is n transfers, each rank's own bytes (vLLM aggregates its
    workers' stats by `aggregate`, as NIXL's connector's are). Lists, so
    aggregation is concatenation: `transfer_s` (pdxfer's elapsed time,
    send/expect to finish), `wire_s` (pdxfer's `RequestStats.wire_s`, where
    measured: always on the prefill, first write posted to last complete; on
    the decode only for a request of several transfers), `bytes`, `segments`
    of successful transfers;
    `failed` (one label per failed transfer, `failure_kind`); `quarantine_s`
    (how long a failed receive stayed Quarantined before it was safe);
    `prefix_fallbacks` (decode requests computed locally because of a local
    prefix-cache hit; counted by the scheduler-side connector).
    """

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = {k: list((data or {}).get(k, ())) for k in _STAT_KEYS}

    def reset(self) -> None:
        """Clear every observation."""
        self.data = {k: [] for k in _STAT_KEYS}

    def clone_and_reset(self) -> PdxferKVConnectorStats:
        """This interval's observations, leaving this one empty for the next."""
        old = PdxferKVConnectorStats(self.data)
        self.reset()
        return old

    def is_empty(self) -> bool:
        """True when nothing was observed (failures and fallbacks count)."""
        return not any(self.data[k] for k in _STAT_KEYS)

    def aggregate(self, other: Any) -> PdxferKVConnectorStats:
        """Add another worker's (or the scheduler's) observations to these."""
        for k in _STAT_KEYS:
            self.data[k].extend(other.data.get(k, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's periodic log line."""
        t = np.asarray(self.data["transfer_s"], dtype=np.float64)
        wire = np.asarray(self.data["wire_s"], dtype=np.float64)
        mb = np.asarray(self.data["bytes"], dtype=np.float64) / 2**20
        n = len(t)
        # Throughput over the wire time where every transfer has one (the prefill's), else over
        # the elapsed time (which includes the wait for the peer: a lower bound).
        per = wire if len(wire) == n and wire.sum() > 0 else t
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Avg transfer time (ms)": round(float(t.mean()) * 1e3, 3) if n else 0,
            "P90 transfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(float(mb.mean()), 3) if n else 0,
            "Avg wire time (ms)": round(float(wire.mean()) * 1e3, 3) if len(wire) else 0,
            "Throughput (MB/s)": round(float(mb.sum() / per.sum()), 3) if n and per.sum() > 0 else 0,
            "Avg segments": round(float(np.mean(self.data["segments"])), 1) if n else 0,
            "Num failed transfers": len(self.data["failed"]),
            "Num quarantined": len(self.data["quarantine_s"]),
            "Num prefix-cache fallbacks": len(self.data["prefix_fallbacks"]),
        }
        for kind in sorted(set(self.data["failed"])):
            out[f"Failed ({kind})"] = self.data["failed"].count(kind)
        return out


class PdxferPromMetrics(KVConnectorPromMetrics):
    """The `vllm:pdxfer_*` Prometheus series, fed from `PdxferKVConnectorStats.data`."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        hist, counter = self._histogram_cls, self._counter_cls
        seconds = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self.transfer_s = per_engine(hist(
            name="vllm:pdxfer_transfer_time_seconds", labelnames=labelnames, buckets=seconds,
            documentation="pdxfer transfers: seconds from send/expect to the request's finish."))
        self.wire_s = per_engine(hist(
            name="vllm:pdxfer_wire_time_seconds", labelnames=labelnames, buckets=seconds,
            documentation="pdxfer transfers: seconds on the wire, first write posted to last "
                          "complete (the prefill's; the decode's for multi-transfer requests)."))
        self.bytes = per_engine(hist(
            name="vllm:pdxfer_bytes_transferred", labelnames=labelnames,
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
            documentation="pdxfer transfers: bytes moved per transfer (one per TP rank)."))
        self.segments = per_engine(hist(
            name="vllm:pdxfer_num_segments", labelnames=labelnames,
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384],
            documentation="pdxfer transfers: contiguous segments posted per transfer."))
        self.quarantine_s = per_engine(hist(
            name="vllm:pdxfer_quarantine_seconds", labelnames=labelnames, buckets=seconds,
            documentation="pdxfer receives that failed over a transport that cannot fence: "
                          "seconds until no byte could land any more."))
        self.fallbacks = per_engine(counter(
            name="vllm:pdxfer_num_prefix_cache_fallbacks", labelnames=labelnames,
            documentation="Remotely prefilled requests the decode computed itself because of a "
                          "local prefix-cache hit of a hybrid (Mamba) model."))
        self._failed = counter(
            name="vllm:pdxfer_num_failed_transfers", labelnames=[*labelnames, "reason"],
            documentation="pdxfer transfers that failed, by cause (the pdxfer exception class, "
                          "or 'aborted').")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's observations under the engine's labels."""
        d = transfer_stats_data
        for metric, key in ((self.transfer_s, "transfer_s"), (self.wire_s, "wire_s"),
                            (self.bytes, "bytes"),
                            (self.segments, "segments"), (self.quarantine_s, "quarantine_s")):
            for v in d.get(key, ()):
                metric[engine_idx].observe(v)
        if d.get("prefix_fallbacks"):
            self.fallbacks[engine_idx].inc(len(d["prefix_fallbacks"]))
        labels = self.per_engine_labelvalues[engine_idx]
        for kind in d.get("failed", ()):
            self._failed.labels(*labels, kind).inc()


# ==== the connector ========================================================================
class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    """pdxfer behind vLLM's KV connector API; one instance per role and process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        _require_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        clip_ssm_state_blocks = _from_vllm("vllm.distributed.kv_transfer.kv_connector.utils",
                                           "clip_ssm_state_blocks")
        MambaSpec, SlidingWindowSpec = _from_vllm("vllm.v1.kv_cache_interface",  # noqa: N806
                                                  "MambaSpec", "SlidingWindowSpec")
        self._status = _from_vllm("vllm.v1.request", "RequestStatus")
        get_ip = _from_vllm("vllm.utils.network_utils", "get_ip")

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
        self._block_sizes = [int(s.block_size) for s in specs]
        self._clip = clip_ssm_state_blocks
        # vLLM takes block-level load errors only where block ids are unique: one cache group.
        self._block_errors = len(kv_cache_config.kv_cache_groups) == 1
        # Mamba: the prefill stops one token short, the decode recomputes it (h(N-1) -> h(N)).
        self._backoff = 1 if kv_cache_config.has_mamba_layers else 0
        if self._backoff and self._consumer and vllm_config.cache_config.enable_prefix_caching:
            # A local hit hands the connector a prefix whose Mamba state the prefill never sent
            # (it ships the state after the whole prompt): the decode would compute the prompt
            # itself while the prefill's blocks wait out request_timeout.
            raise ConfigError("PdxferConnector on the decode (kv_role "
                              f"{ktc.kv_role!r}) of a hybrid (Mamba) model needs prefix caching "
                              "off: a local prefix hit cannot resume the Mamba state the prefill "
                              "sends; start the decode with --no-enable-prefix-caching (the "
                              "prefill may keep it on)")
        given = ktc.get_from_extra_config("pdxfer", None)
        text = json.dumps(given) if given is not None else os.environ.get(CONFIG_ENV)
        self.config = engine_config(text, host=get_ip, request_timeout=SERVING_REQUEST_TIMEOUT)
        self._init_streaming(ktc, specs)
        # scheduler side
        # vLLM id -> (pdxfer id, prefill addresses, tail blocks per group, cached blocks per group)
        self._to_recv: dict[str, tuple[str, list[str], list[list[int]], list[int]]] = {}
        self._to_send: dict[str, list[list[int]]] = {}
        self._to_hold: dict[str, list[str]] = {}
        self._to_unhold: set[str] = set()
        self._queued: dict[str, str] = {}  # decode: vLLM id -> pdxfer id, held until allocated
        self._held: set[str] = set()  # prefill requests whose blocks wait for finished_sending
        self._addresses: list[str] = []
        # worker side
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        self._recving: dict[str, tuple[str, list[list[int]]]] = {}  # vLLM id -> (pdxfer id, blocks)
        self._sending: set[str] = set()
        self._failed: set[str] = set()
        self._aborted: set[str] = set()  # receives vLLM finished first (aborts), aborted in pdxfer
        self._quarantined: dict[str, float] = {}  # pdxfer id -> when first seen Quarantined
        self._load_errors: set[int] = set()
        self._rank = 0  # this worker's TP rank, known once vLLM's groups exist (register_kv_caches)
        # both sides: this interval's observations (None: vLLM's metrics API is not there)
        self._stats = PdxferKVConnectorStats() if _NO_METRICS is None else None

    # ==== class-level answers ====================================================
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: pdxfer registers the KV memory once and cannot follow sleep mode's remap."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """LBNHC (vLLM's default; layer-outer, each block's bytes one run) for MHA, None for MLA.

        Asked for so that both sides lay blocks out alike whatever backend
        each picked (FlashInfer would pick LBHNC); the layout is also part
        of the identity the handshake compares (`engine_identity`).
        """
        mc = getattr(vllm_config, "model_config", None)
        if mc is None or getattr(mc, "use_mla", False):
            return None
        return "LBNHC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """The stats object for `data` a worker's `get_kv_connector_stats` produced."""
        if _NO_METRICS is not None:
            return None
        return PdxferKVConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """The `vllm:pdxfer_*` series (`PdxferPromMetrics`)."""
        if _NO_METRICS is not None:
            return None
        return PdxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> Any:
        """This interval's observations (None when there are none), and start the next."""
        if self._stats is None or self._stats.is_empty():
            return None
        return self._stats.clone_and_reset()

    # ==== scheduler side =========================================================
    def _transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Block ids per transfer group, clipped as vLLM's connectors clip them."""
        chosen = self._kv_cache_config.select_transfer_block_ids(list(block_ids))
        return [list(self._clip(list(b), n)) if n is not None and b else list(b)
                for b, n in zip(chosen, self._ssm_spec, strict=True)]

    def on_new_request(self, request: Any) -> None:
        """A remote prefill's request is kept alive on its prefill while it waits here; on the
        prefill side of a Mamba model, all but the last prompt token are computed (the decode
        recomputes it)."""
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill") and p.get("remote_request_id") and self._consumer:
            # Queued here, maybe for minutes under load: the worker renews the prefill's hold
            # (pdxfer's Renew) until the Expect takes over, so the send does not time out first.
            pid = str(p["remote_request_id"])
            self._queued[request.request_id] = pid
            self._to_hold[pid] = list(p.get("remote_addresses") or [])
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
        cached = cached_blocks(num_computed_tokens, self._block_sizes, self._ssm_spec)
        if cached is None:
            if not p.get("_pdxfer_local_hit"):  # asked again each step it waits: say it once
                p["_pdxfer_local_hit"] = True
                log.warning("pdxfer: request %s has %d tokens cached locally in a hybrid (Mamba) "
                            "model, whose state cannot resume from a prefix; the decode computes "
                            "it itself and the prefill's send waits out its request_timeout "
                            "(%.0f s)", request.request_id, num_computed_tokens,
                            self.config.request_wait)
                if self._stats is not None:
                    self._stats.data["prefix_fallbacks"].append(num_computed_tokens)
            return 0, False
        # A local prefix hit loads only the uncached tail: the Expect names its offset per group.
        p["_pdxfer_cached"] = cached
        n = request.num_prompt_tokens - (self._backoff if request.num_prompt_tokens > self._backoff else 0)
        n -= num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: remember the blocks the prefill will write; once per request."""
        p = request.kv_transfer_params
        self._stream_candidate(request, blocks)
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False
        held = self._queued.pop(request.request_id, None)  # the Expect takes over the hold
        if num_external_tokens <= 0:
            if held is not None:  # computed here after all: no Expect, so stop renewing
                self._to_hold.pop(held, None)
                self._to_unhold.add(held)
            return
        addrs = list(p.get("remote_addresses") or [])
        # The unhashed blocks are the new ones: with a local prefix hit, the tail's only.
        tail = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
        cached = p.pop("_pdxfer_cached", None) or [0] * len(tail)
        self._to_recv[request.request_id] = (str(p["remote_request_id"]), addrs, tail, cached)

    def build_connector_meta(self, scheduler_output: Any) -> PdxferConnectorMetadata:
        """This step's expects and sends, handed to every worker."""
        meta = PdxferConnectorMetadata()
        meta.recv, meta.send = self._to_recv, self._to_send
        meta.hold, meta.unhold = self._to_hold, self._to_unhold
        self._to_recv, self._to_send, self._to_hold, self._to_unhold = {}, {}, {}, set()
        self._stream_meta(scheduler_output, meta)
        meta.abort, self._to_abort = meta.abort + self._to_abort, []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Single-group models: as `request_finished_all_groups`."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict | None]:
        """Prefill: hold a finished request's blocks for the push; params for the decode request."""
        p = request.kv_transfer_params
        if not p:
            return False, None
        streamed = self._streamed_finished(request)
        if streamed is not None:
            return streamed
        if p.get("do_remote_prefill"):  # a decode request that ended before its blocks came
            p["do_remote_prefill"] = False
            pid = self._queued.pop(request.request_id, None)
            if pid is not None:
                self._to_hold.pop(pid, None)
                self._to_unhold.add(pid)
            return False, None
        if not p.get("do_remote_decode") or request.status not in (
                self._status.FINISHED_LENGTH_CAPPED, self._status.FINISHED_STOPPED):
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
        return bool(self._held or self._to_send or self._to_abort)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' prefill addresses, in TP rank order."""
        self._addresses = [metadata[r].address for r in sorted(metadata)]

    # ==== worker side ============================================================
    def _tp_rank(self) -> int:
        if self._tp_size == 1:
            return 0
        get_tp_group = _from_vllm("vllm.distributed.parallel_state", "get_tp_group")
        return int(get_tp_group().rank_in_group)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Adopt the layers' caches as one pool per group and start the engine(s) over them."""
        groups = [g.layer_names for g in self._kv_cache_config.transfer_groups]
        attention = [n for names, ssm in zip(groups, self._ssm_spec, strict=True) if ssm is None
                     for n in names]
        self._rank = self._tp_rank()
        identity = engine_identity(self._vllm_config, _attention_backends(self._vllm_config, attention))
        pools = group_pools(kv_caches, groups, int(self._kv_cache_config.num_blocks), identity)
        if self._producer:
            self.prefill = PrefillEngine(pools, self.config)
            if self._layer_groups:
                names = groups[0]
                # A layer's block views are one or two tensors of each field (K and V of equal
                # shapes share one): the pool's layer axis holds `stride` entries per layer.
                axis = max(f.layers for f in pools["g0"].fields)
                stride = axis // len(names)
                if stride * len(names) != axis:
                    raise ConfigError(f"pdxfer_layer_groups: the cache group's {len(names)} layers "
                                      f"make {axis} tensors per field, not a whole number per "
                                      "layer; set pdxfer_layer_groups to 0 for this model")
                self._stream = LayerStream(self.prefill.send, {n: i for i, n in enumerate(names)},
                                           len(names), self._layer_groups,
                                           lambda rid, exc: self._failed.add(rid), stride=stride)
        if self._consumer:
            self.decode = DecodeEngine(pools, self.config)

    def get_handshake_metadata(self) -> PdxferHandshake | None:
        """This worker's prefill address, for the scheduler's `kv_transfer_params`."""
        return PdxferHandshake(self.prefill.bootstrap_address) if self.prefill is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Expect this step's remote prefills; send this step's finished prefills."""
        meta = self._get_connector_metadata()
        rank = self._rank
        if self.decode is not None:
            for pid, addrs in meta.hold.items():
                if len(addrs) == self._tp_size:  # a TP mismatch is refused at the Expect
                    try:
                        self.decode.hold(pid, addrs[rank])
                    except PdxferError as exc:
                        log.warning("pdxfer: cannot keep request %s alive on its prefill: %s",
                                    pid, exc)
            for pid in meta.unhold:
                self.decode.unhold(pid)
        for rid, (pid, addrs, blocks, cached) in meta.recv.items():
            self._recving[rid] = (pid, blocks)
            try:
                if self.decode is None:
                    raise ConfigError("this worker has no decode engine (kv_role is not a consumer)")
                if len(addrs) != self._tp_size:
                    raise ConfigError(f"the prefill runs {len(addrs)} TP ranks, this decode "
                                      f"{self._tp_size}; PdxferConnector pairs rank r with rank r "
                                      "and supports equal TP sizes only")
                indices, offsets = tail_expect(blocks, cached)
                self.decode.expect(pid, addrs[rank], indices, offsets=offsets)
            except PdxferError as exc:
                log.error("pdxfer: request %s cannot be received: %s", rid, exc)
                self._failed.add(rid)
        self._start_streams(meta)
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
        """Streaming (`pdxfer_layer_groups`): send the layer group this layer closes; else nothing
        (finished requests are pushed whole from start_load_kv)."""
        if self._stream is not None:
            # vLLM binds the step's metadata before the forward but calls start_load_kv after
            # it (async loads): the streams of the step begin at its first layer.
            self._start_streams(self._get_connector_metadata())
            self._stream.layer_done(layer_name)

    def wait_for_save(self) -> None:
        """Streaming: the pass ended, send what it did not report. Sends are asynchronous; their
        blocks stay held until `finished_sending`."""
        if self._stream is not None:
            self._stream.finish()

    # ==== streamed layer groups (#33) ==============================================
    def _init_streaming(self, ktc: Any, specs: Sequence[Any]) -> None:
        """`kv_connector_extra_config={"pdxfer_layer_groups": N}`: stream a prefill's blocks in N
        layer groups during its forward pass (0, the default: push finished requests whole).

        Both sides of the connector decide alike from the cache config: one attention group
        (no Mamba, one layer axis) streams; any other model keeps whole pushes, said once.
        Only a request whose whole prompt (less any prefix hit) runs in one step is streamed;
        one chunked over several steps is pushed whole when it finishes.
        """
        groups = ktc.get_from_extra_config("pdxfer_layer_groups", 0)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
            raise ConfigError(f"pdxfer_layer_groups must be an int >= 0 (0: off), got {groups!r}")
        self._layer_groups = groups if self._producer else 0
        if self._layer_groups and (len(specs) != 1 or self._ssm_spec[0] is not None):
            log.warning("pdxfer: pdxfer_layer_groups=%d ignored: streaming needs one attention "
                        "cache group (this model has %d groups%s); finished requests are "
                        "pushed whole", groups, len(specs),
                        ", Mamba" if any(s is not None for s in self._ssm_spec) else "")
            self._layer_groups = 0
        self._candidates: dict[str, tuple[Any, list[list[int]]]] = {}  # scheduler: allocated now
        self._streamed: set[str] = set()  # scheduler: streamed by the workers, not pushed again
        self._to_abort: list[str] = []  # scheduler: streamed requests the workers must abort
        self._stream: LayerStream | None = None  # worker
        self._streams_of: Any = None  # worker: the step metadata whose streams began

    def _stream_candidate(self, request: Any, blocks: Any) -> None:
        """Scheduler, at allocation: a prefill request that may stream in this step."""
        p = request.kv_transfer_params
        if self._layer_groups and p and p.get("do_remote_decode"):
            self._candidates[request.request_id] = (request, blocks.get_block_ids())

    def _stream_meta(self, scheduler_output: Any, meta: Any) -> None:
        """Scheduler: this step's streamed requests — those its forward prefills to the end."""
        meta.stream, meta.abort = {}, []
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid, (request, block_ids) in self._candidates.items():
            n = scheduled.get(rid, 0)
            # Called before vLLM advances num_computed_tokens by this step's tokens.
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                blocks = self._transfer_blocks(block_ids)
                if any(blocks):
                    meta.stream[rid] = blocks
                    self._streamed.add(rid)
        self._candidates = {}

    def _streamed_finished(self, request: Any) -> tuple[bool, dict | None] | None:
        """Scheduler: a streamed request finished; its blocks are held until pdxfer is done
        with them (aborted in pdxfer first unless it ended normally with addresses to give)."""
        rid = request.request_id
        if rid not in self._streamed:
            return None
        self._streamed.discard(rid)
        self._held.add(rid)
        normal = request.status in (self._status.FINISHED_LENGTH_CAPPED,
                                    self._status.FINISHED_STOPPED)
        if not normal or len(self._addresses) != self._tp_size:
            self._to_abort.append(rid)
            return True, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_request_id": rid, "remote_addresses": list(self._addresses),
                      "tp_size": self._tp_size, "remote_num_tokens": request.num_computed_tokens,
                      "transfer_mode": "push"}

    def _start_streams(self, meta: Any) -> None:
        """Worker, at the step's first layer (or its start_load_kv): begin this step's streams
        and abort the ones given up; once per step's metadata."""
        if meta is self._streams_of:
            return
        self._streams_of = meta
        for rid in getattr(meta, "abort", ()):
            self._sending.add(rid)
            if self.prefill is not None:
                try:
                    self.prefill.abort(rid, "vLLM finished the request before it was handed off")
                except PdxferError:
                    pass  # finished meanwhile: get_transfer_results reports it
        for rid, blocks in getattr(meta, "stream", {}).items():
            self._sending.add(rid)
            if self._stream is None:
                log.error("pdxfer: request %s cannot be streamed: this worker has no prefill "
                          "engine streaming layer groups", rid)
                self._failed.add(rid)
                continue
            self._stream.begin(rid, {f"g{g}": b for g, b in enumerate(blocks) if b})

    def _finished(self, engine: Any, pid: str, rid: str) -> tuple[KVPoll, str] | None:
        """`(final state, failure kind)` once it is safe to report (released then), else None."""
        if rid in self._failed:
            self._failed.discard(rid)
            try:
                engine.release(pid)
            except (PdxferError, AttributeError):
                pass
            return KVPoll.Failed, "ConfigError"
        try:
            out = engine.outcome(pid)
        except UnknownRequestError:  # a prefill sender before the decode's Expect
            return None
        if out.state is KVPoll.Quarantined:
            self._quarantined.setdefault(pid, time.monotonic())
        state = engine_poll(out.state)
        if not state.finished:
            return None
        try:
            out = engine.release(pid)
        except UnknownRequestError:
            pass
        since = self._quarantined.pop(pid, None)
        if self._stats is not None:
            if since is not None:
                self._stats.data["quarantine_s"].append(time.monotonic() - since)
            if state is KVPoll.Success:
                self._stats.data["transfer_s"].append(out.stats.elapsed_s)
                if out.stats.wire_s > 0:  # the decode sees one transfer's arrival, not its wire time
                    self._stats.data["wire_s"].append(out.stats.wire_s)
                self._stats.data["bytes"].append(out.stats.nbytes)
                self._stats.data["segments"].append(out.stats.segments)
        kind = failure_kind(out.cause, out.reason) if state is KVPoll.Failed else ""
        if state is KVPoll.Failed:
            if self._stats is not None:
                self._stats.data["failed"].append(kind)
            log.warning("pdxfer: transfer of %s failed: %s", rid, out.reason or kind)
        return state, kind

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Sends and receives that finished (Success or Failed), failed receives named.

        A receive vLLM has finished meanwhile (`finished_req_ids`: an abort in
        `WAITING_FOR_REMOTE_KVS`) is aborted in pdxfer now, which tells its
        prefill; it is reported finished (never failed: there is nothing to
        recompute) once no byte can land in its blocks.
        """
        out = KVConnectorTransferResults()
        for rid in finished_req_ids or ():
            if rid in self._recving and rid not in self._aborted and self.decode is not None:
                self._aborted.add(rid)
                try:
                    self.decode.abort(self._recving[rid][0], "vLLM finished the request while "
                                      "its KV was loading")
                except PdxferError:
                    pass  # finished (or never started) meanwhile: the poll below reports it
        for rid in list(self._sending):
            done = self._finished(self.prefill, rid, rid)
            if done is not None:
                self._sending.discard(rid)
                out.finished_sending.add(rid)
        for rid, (pid, blocks) in list(self._recving.items()):
            done = self._finished(self.decode, pid, rid)
            if done is None:
                continue
            del self._recving[rid]
            out.finished_recving.add(rid)
            aborted = rid in self._aborted
            self._aborted.discard(rid)
            if done[0] is KVPoll.Failed and not aborted:
                if self._block_errors:
                    self._load_errors.update(b for g in blocks for b in g)
                else:
                    out.failed_recving.add(rid)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call (single-group models).

        pdxfer fails a request whole, and says Failed only once nothing can
        land any more: every block a failed receive expected is unreliable,
        and no other block is.
        """
        errors, self._load_errors = self._load_errors, set()
        return errors

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
    """`vllm.general_plugins` entry point: `"kv_connector": "PdxferConnector"` by name.

    Never raises: vLLM calls plugins without a guard in every one of its
    processes, so a raise here would stop vLLM even where pdxfer is not
    configured. Whatever goes wrong is one warning, and the connector is
    then not registered by name (loading it by module path says why again).
    """
    try:
        _require_vllm()
        factory = _from_vllm("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory")
        try:
            factory.register_connector(NAME, __name__, NAME)
        except ValueError:  # "already registered": plugins loaded a second time in this process
            pass
    except Exception as exc:
        log.warning("pdxfer: the %s plugin is not registered (vLLM runs on without it): %s",
                    NAME, exc)
