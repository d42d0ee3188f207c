"""pdxfer as an SGLang disaggregation transfer backend: `--disaggregation-transfer-backend pdxfer`.

SGLang (0.5.23, `sglang.srt.disaggregation`) drives a backend through four
classes; this module is them over pdxfer's engines, plus `register()`, the
`sglang.srt.plugins` entry point that makes the flag resolve to them without
patching SGLang (pdxfer's pyproject declares it; `pip install pdxfer` is all
an SGLang install needs).

What maps to what:

- **`PdxferKVManager`** (one per scheduler rank). SGLang hands it `KVArgs`:
  raw pointers, lengths and item lengths of the per-layer K/V buffers, the
  metadata ("aux") rows and each hybrid state component (`StateType`). They
  become pdxfer pools, each adopted through `layout.adopt_ranges` against a
  declaration made from those same lists (`kit.buffer_pool`): `"kv"` (an
  entry is a page of every layer's K and V), `"aux"` (an entry is a metadata
  row), and `"state.<type>"` per state component (an entry is one item of
  its buffers: a Mamba slot). The prefill side runs a `PrefillEngine`, the
  decode side a `DecodeEngine`; pdxfer's handshake compares the pools, so a
  layout mismatch fails the request with pdxfer's reason, which SGLang logs
  and puts in the abort it streams.
- **Bootstrap.** SGLang's own registry, not a new one: `PdxferKVBootstrapServer`
  *is* SGLang's `CommonKVBootstrapServer` (the HTTP `/route` table the router
  already points decode at, which the Rust registry can stand in for, with
  the DP-rank queries). Each prefill rank registers its pdxfer control
  address there as its `rank_ip:rank_port`; a decode rank looks its peer up
  once per prefill (`try_ensure_parallel_info`, in a worker thread: the
  scheduler never waits on the network longer than a short bound) and then
  speaks pdxfer's own handshake to it. The registry carries addresses only;
  the layout check, liveness and fencing are pdxfer's.
- **TP ranks.** At equal attention TP sizes decode rank r receives from
  prefill rank r. MLA at a prefill TP k times the decode's (prefill TP 8 to
  decode DP attention, the DeepSeek shape): MLA's latent cache is
  replicated over the prefill's ranks, so a decode rank reads one replica
  whole, from one rank of its group of k (chosen by room, spreading the
  load), and expects the other k - 1 with nothing to send (empty
  destinations, every entry skipped), which finishes their senders: MLA
  moves once, from one rank. Per-head K/V (MHA, GQA) cannot be resliced
  here (SGLang's per-layer buffers hold a token's heads together), nor can
  hybrid state: those, other MLA ratios, CP and PP fail each request with
  the reason (`mixed_tp_refusal`) instead of crashing the scheduler. SGLang
  all-reduces (MIN) each poll over the TP group, so a request commits when
  every rank's copy did.
- **Prefill DP.** Each prefill DP rank registers under its DP rank; with a
  load balancer other than `follow_bootstrap_room` (or
  `SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`) each sender registers
  its room, and SGLang's decode queries the rooms' DP ranks on the manager's
  `_ensure_prefill_recompute_executor`, as for its own managers.
- **Multi-node prefill.** Ranks register where SGLang's bootstrap server
  runs: `--dist-init-addr`'s host when set (the tokenizer manager's node),
  else the serving host; with `--nnodes` > 1 at node 0's bootstrap port.
- **One rank fails, every rank frees.** When one decode rank's transfer
  fails, SGLang's MIN makes every rank see Failed and free its pages; a
  sibling rank's pdxfer request may still be live, its prefill still
  writing. SGLang's deferred decode KV release (on by default) holds the
  pages on every rank until each rank's manager says
  `is_abort_release_safe`: here `ensure_abort_notified` aborts this rank's
  live request, and the answer is exact, from the engine's state (finished:
  Failed after a fence or at the end of a quarantine), not acks or a
  timeout. `failure_exception` says when the failure came from another rank
  (`is_from_another_rank`). Decode TP > 1 with the deferred release turned
  off is refused at start; `clear()` on a live request aborts it.
- **Requests.** A request's pdxfer id is its `bootstrap_room` and the
  prefill TP rank that serves it (`request_id`: both sides compute it
  alone). The decode receiver's `send_metadata` is `DecodeEngine.expect` with
  the destination pages, its aux row and its state slots; each prefill
  `send` is one `PrefillEngine.send` chunk. SGLang passes no "last" flag: its
  last chunk is the one carrying `state_indices` (a list, empty without state
  components), and it ships the aux row and the state components too (a
  zero-page last chunk still does: `should_send_kv_chunk`); the pages sent
  must then add up to `init(num_pages)`. SGLang holds back a partial last page until
  the next chunk itself; pdxfer sees whole pages only.
- **The aux row.** SGLang's decode commits a request only once the aux
  row's `bootstrap_room` is non-zero, and checks it against the request's:
  the row travels in the last chunk, so Success covers it; a corrupted row is
  SGLang's own check to catch.
- **States** (`kit.engine_poll`): pdxfer's `Quarantined` never reaches
  SGLang. A decode request that may still be written reads as `Transferring`
  until pdxfer can say `Failed` safely, because on `Failed` SGLang frees the
  decode pages at once. A request SGLang has seen finish is released from
  the engine then, its outcome kept on the sender/receiver for
  `failure_exception` and the metrics.

Configuration: `PDXFER_CONFIG` (JSON `EngineConfig` fields, `kit.engine_config`);
the host defaults to the address SGLang's own backends advertise, and
`request_timeout` (a request's wait while its peer is alive) to SGLang's own
setting: `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` on the prefill (how long
it waits for the decode's Expect), `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` on
the decode (300 s each by default); `timeout` stays pdxfer's short liveness
bound. A decode radix-cache prefix (`decode_prefix_len`, whole pages) is an
Expect for the tail with an offset (`offsets`): the prefill, told nothing
by SGLang, sends every page, and pdxfer ships the tail only. Not supported
(each refused with the reason): host destinations, staging buffers, mixed
TP other than MLA's, CP and PP, hybrid state components other than Mamba
(`unsupported_states`), decode TP > 1 without SGLang's deferred KV release,
and `release_memory_occupation` of the KV cache under `--enable-memory-saver`.
`transfer_latency_s` is `RequestStats.wire_s`, the time on the wire.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..config import KVPoll
from ..decode import DecodeEngine
from ..errors import (
    ConfigError,
    PdxferError,
    RequestFailed,
    TransportError,
    UnknownRequestError,
)
from ..prefill import PrefillEngine
from ..requests import RequestOutcome
from ..session import format_address, parse_address
from .kit import CONFIG_ENV, buffer_pool, engine_config, engine_poll, pool_indices

try:  # the engine is optional: this module imports (and is unit-tested) without it
    from sglang.srt.disaggregation.base.conn import (
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVTransferMetric,
    )
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    _MISSING: ImportError | None = None
except ImportError as exc:  # noqa: F841 — kept for the message
    BaseKVManager = BaseKVSender = BaseKVReceiver = CommonKVBootstrapServer = object  # type: ignore[misc,assignment]
    KVTransferMetric = None  # type: ignore[assignment]
    _MISSING = exc

log = logging.getLogger("pdxfer.sglang")

NAME = "pdxfer"  # the --disaggregation-transfer-backend value
# How long the scheduler thread waits for a prefill's registry lookup before
# try_ensure_parallel_info says "not yet" (SGLang retries it; a local
# registry answers in milliseconds, a dead one never stalls the loop longer).
_LOOKUP_WAIT_S = 0.2


def _require_sglang() -> None:
    if _MISSING is not None:
        raise ImportError(f"pdxfer's SGLang backend needs SGLang installed (pip install sglang): "
                          f"{_MISSING}") from _MISSING


def _http_json(method: str, url: str, timeout: float, body: dict | None = None) -> tuple[int, Any]:
    """`(status, parsed JSON or text)` of one request to SGLang's bootstrap registry."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def kvargs_pools(args: Any, device: str) -> dict[str, Any]:
    """pdxfer pools over SGLang's `KVArgs` buffers: `kv`, `aux`, and one per state component."""
    pools = {
        "kv": buffer_pool("kv", args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                          rows=int(args.page_size), device=device),
        # MetadataBuffers live in host memory on every device SGLang runs PD on but NPU.
        "aux": buffer_pool("aux", args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens),
    }
    for st, ptrs, lens, items in zip(args.state_types, args.state_data_ptrs, args.state_data_lens,
                                     args.state_item_lens, strict=True):
        name = f"state.{getattr(st, 'value', st)}"
        pools[name] = buffer_pool(name, ptrs, lens, items, device=device)
    return pools


def _refusal(info: dict, mgr: PdxferKVManager) -> str | None:
    """Why this decode rank cannot take requests from a prefill with `info`, or None."""
    page, dtype = mgr.kv_args.page_size, getattr(mgr.kv_args, "kv_cache_dtype_str", None)
    if info.get("page_size") not in (None, page):
        return (f"prefill page_size={info['page_size']}, decode page_size={page}; run both "
                "with the same --page-size")
    if info.get("kv_cache_dtype") not in (None, dtype):
        return (f"prefill kv_cache_dtype={info['kv_cache_dtype']}, decode {dtype}; run both "
                "with the same --kv-cache-dtype")
    if int(info.get("attn_cp_size", 1)) != 1 or int(info.get("pp_size", 1)) != 1:
        return (f"prefill attn_cp_size={info.get('attn_cp_size')}, pp_size={info.get('pp_size')}: "
                "pdxfer's SGLang backend supports neither context nor pipeline parallel prefill")
    return mixed_tp_refusal(int(info.get("attn_tp_size", 1)), mgr.attn_tp_size,
                            mla=mgr.is_mla_backend, states=mgr.state_pools)


def mixed_tp_refusal(prefill_tp: int, decode_tp: int, *, mla: bool, states: list[str]) -> str | None:
    """Why a decode at attention TP `decode_tp` cannot read a prefill at `prefill_tp`, or None.

    Equal sizes pair TP rank r with TP rank r. Different sizes work for MLA
    only, with the prefill's a multiple of the decode's: MLA's latent cache
    is replicated over the attention TP ranks, so a decode rank reads one
    prefill replica whole (`source_ranks`) and reslices nothing. Per-head
    K/V (MHA, GQA) would need each page cut by head: SGLang's per-layer
    buffers hold a token's heads together, so a head slice is one strided
    piece per token, which pdxfer's pools do not describe; hybrid state
    (Mamba/GDN) is split across TP ranks the same way.
    """
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill attn_tp_size={prefill_tp}, decode attn_tp_size={decode_tp}"
    if not mla:
        return (f"{sizes}: MHA/GQA K/V is split by head across TP ranks, and pdxfer's SGLang "
                "backend does not reslice heads (SGLang's per-layer buffers hold each token's "
                "heads together); run both with the same TP size (mixed TP works for MLA models)")
    if states:
        return (f"{sizes}: the model's hybrid state components {states} are split across TP "
                "ranks, and pdxfer's SGLang backend does not reslice them; run both with the "
                "same TP size")
    if prefill_tp % decode_tp:
        return (f"{sizes}: for MLA pdxfer's SGLang backend needs the prefill's attention TP size "
                "to be a multiple of the decode's (each decode rank reads one prefill replica; "
                "one prefill rank serving several decode ranks is not supported); use decode "
                "attention DP (--enable-dp-attention) or a prefill TP size that is a multiple")
    return None


def source_ranks(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int]:
    """The prefill TP ranks decode rank `decode_rank` hears from: its replica group, in rank order.

    Equal sizes: rank r alone. MLA at a prefill TP k times the decode's: the
    k prefill ranks whose replicas are this decode rank's; one of them
    (`replica_rank`) sends the pages, the others are told there is nothing
    for them.
    """
    k = prefill_tp // decode_tp
    return list(range(decode_rank * k, (decode_rank + 1) * k))


def replica_rank(group: list[int], room: int) -> int:
    """The prefill rank of `group` that sends `room`'s pages: spread over the group by room."""
    return group[room % len(group)]


def request_id(room: int | None, prefill_rank: int) -> str:
    """The pdxfer request id of `room`'s transfer from prefill attention TP rank `prefill_rank`.

    Each prefill rank's id is its own, so a decode rank that hears from
    several prefill ranks (MLA, mixed TP) holds one engine request per rank;
    both sides compute it from what each knows alone.
    """
    return f"{room}#tp{int(prefill_rank)}"


# The hybrid state components this backend moves: Mamba/GDN slots, one item per slot
# (tests/engines: a real `MambaPool`). The others index their buffers differently (SWA
# and DSA by token window or ring row, BLOCK_SCALE parallel to K/V pages, ...) and
# nothing here checks that one item per index is what they mean: refused by name.
SUPPORTED_STATES = frozenset({"mamba"})


def unsupported_states(state_types: Any) -> str | None:
    """Why pdxfer's SGLang backend refuses these hybrid `StateType`s, or None."""
    names = [str(getattr(st, "value", st)) for st in state_types]
    bad = [n for n in names if n not in SUPPORTED_STATES]
    if not bad:
        return None
    return (f"hybrid state component(s) {bad} (SGLang StateType): pdxfer's SGLang backend moves "
            f"{sorted(SUPPORTED_STATES)} state only; serve this model with another "
            "--disaggregation-transfer-backend")


def _registry_host(serving_host: str, dist_init_addr: str | None) -> str:
    """Where SGLang's bootstrap server runs, as its own managers find it.

    It starts only beside the tokenizer manager, i.e. on `dist_init_addr`'s
    host when one is given (multi-node prefill: the ranks of node 1 must
    register there, not on their own `--host`); otherwise on the serving
    host, a wildcard bind reached through the loopback of its family.
    """
    if dist_init_addr:
        from sglang.srt.utils.network import NetworkAddress

        return NetworkAddress.parse(dist_init_addr).resolved().host
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(serving_host, serving_host)


class PdxferKVManager(BaseKVManager):
    """One scheduler rank's pdxfer engine over SGLang's buffers, and its bootstrap registration."""

    supports_host_destination = False
    # SGLang's deferred decode KV release (on by default): pdxfer answers its drain question
    # exactly (`is_abort_release_safe`), from the engine's own state, not from acks.
    supports_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        _require_sglang()
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_device, get_disagg, get_parallel, get_serving
        from sglang.srt.utils.network import get_local_ip_auto

        self.kv_args, self.server_args = args, server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.mode = str(getattr(disaggregation_mode, "value", disaggregation_mode))
        par = get_parallel()
        self.attn_tp_size, self.attn_tp_rank = int(par.attn_tp_size), int(par.attn_tp_rank)
        self.attn_cp_size, self.attn_cp_rank = int(par.attn_cp_size), int(par.attn_cp_rank)
        self.attn_dp_size, self.attn_dp_rank = int(par.attn_dp_size), int(par.attn_dp_rank)
        self.pp_size, self.pp_rank = int(par.pp_size), int(getattr(args, "pp_rank", 0) or 0)
        self.system_dp_size = int(par.dp_size)
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.load_balance_method = par.load_balance_method
        # SGLang's own rule (CommonKVSender.__init__): a prefill DP rank registers each room
        # unless the decode can compute it (follow_bootstrap_room, not forced to query).
        self.force_query_dp_rank = bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get())
        self.follow_bootstrap_room = (self.load_balance_method == "follow_bootstrap_room"
                                      and not self.force_query_dp_rank)
        self.bootstrap_port = int(get_disagg().disaggregation_bootstrap_port)
        self.dist_init_addr = getattr(par, "dist_init_addr", None)
        self.nnodes = int(getattr(par, "nnodes", 1) or 1)
        self.bootstrap_host = _registry_host(get_serving().host, self.dist_init_addr)
        refused = unsupported_states(args.state_types)
        if refused:
            raise ConfigError(refused)
        self.enable_deferred_decode_kv_release = bool(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())
        if (self.mode == "decode" and self.attn_tp_size * self.attn_cp_size * self.pp_size > 1
                and not self.enable_deferred_decode_kv_release):
            # SGLang MIN-reduces the ranks' polls and frees every rank's pages at once when one
            # rank fails; without the deferred release a sibling rank's pdxfer request may still
            # be written then. Refused rather than corrupting pages.
            raise ConfigError(
                "pdxfer's SGLang backend at decode attn_tp_size="
                f"{self.attn_tp_size}, attn_cp_size={self.attn_cp_size}, pp_size={self.pp_size} "
                "needs SGLang's deferred decode KV release (one rank's failure would free every "
                "rank's pages while another rank's transfer still writes them); unset "
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0 (its default is on)")
        dev = get_device()
        device = "cpu" if dev.device == "cpu" else f"{dev.device}:{int(getattr(args, 'gpu_id', 0))}"
        # SGLang's per-request waits are pdxfer's request_timeout (the prefill waits for the
        # decode's Expect up to the bootstrap timeout, the decode for its transfer up to the
        # waiting timeout); pdxfer's `timeout` stays the short liveness bound. PDXFER_CONFIG wins.
        wait_env = (envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT if self.mode == "prefill"
                    else envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
        self.config = engine_config(os.environ.get(CONFIG_ENV), host=get_local_ip_auto,
                                    request_timeout=float(wait_env.get()))
        if self.mode == "decode" and self.enable_deferred_decode_kv_release:
            hold = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
            drain = self.config.timeout + 2 * self.config.grace
            if hold < drain:
                log.warning(
                    "pdxfer decode: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=%s s is "
                    "shorter than pdxfer's drain bound for a live prefill (timeout %s s + 2 x grace "
                    "%s s = %s s); SGLang releases a held page at its deadline even if a write may "
                    "still land: raise it", hold, self.config.timeout, self.config.grace, drain)
        self.pools = kvargs_pools(args, device)
        self.state_pools = [f"state.{getattr(st, 'value', st)}" for st in args.state_types]
        engine_cls = PrefillEngine if self.mode == "prefill" else DecodeEngine
        self.engine = engine_cls(self.pools, self.config)
        # Read by DecodePreallocQueue: bootstrap address -> prefill info (dp_size,
        # follow_bootstrap_room) once try_ensure_parallel_info said True.
        self.prefill_info_table: dict[str, SimpleNamespace] = {}
        self._lookups: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix=f"pdxfer-sglang-{self.mode}")
        # The executor SGLang's decode prefetches prefill DP-rank lookups on
        # (`prefetch_prefill_dp_rank_queries`), made on first use as its managers make it.
        self._prefill_recompute_executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Requests SGLang forgot (clear()) while pdxfer still held them live: aborted then,
        # released once finished (`reap`), so the engine's table does not grow.
        self._orphans: set[str] = set()
        # Decode: room -> the engine requests it holds on this rank (`expecting`).
        self._rooms: dict[Any, list[str]] = {}
        if self.mode == "prefill":
            try:
                self.register_to_bootstrap()
            except BaseException:
                self.close()
                raise

    # -- prefill: the registry ---------------------------------------------------------
    def _registry(self, host: str | None = None, port: int | None = None) -> str:
        return f"http://{format_address(host or self.bootstrap_host, port or self.bootstrap_port)}"

    def register_to_bootstrap(self) -> None:
        """Put this rank's pdxfer address in SGLang's bootstrap registry (retried until bootstrap_wait)."""
        host, port = parse_address(self.engine.bootstrap_address)
        if self.dist_init_addr and self.nnodes > 1:
            # As SGLang's managers do: a launcher may reserve a bootstrap port per host, and
            # only node 0's has a server behind it; every rank registers at rank 0's port.
            from sglang.srt.runtime_context import get_parallel

            self.bootstrap_port = int(get_parallel().world_group.broadcast_object(
                self.bootstrap_port, src=0))
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": host, "rank_port": port, "page_size": int(self.kv_args.page_size),
            "kv_cache_dtype": getattr(self.kv_args, "kv_cache_dtype_str", None),
            "load_balance_method": self.load_balance_method,
        }
        url = f"{self._registry()}/route"
        deadline = time.monotonic() + self.config.bootstrap_wait
        while True:
            try:
                status, body = _http_json("PUT", url, self.config.connect_wait, payload)
                if status == 200:
                    return
                why = f"status {status}: {body}"
            except OSError as exc:
                why = str(exc)
            if time.monotonic() > deadline:
                raise TransportError(
                    f"pdxfer prefill rank {self.attn_tp_rank} could not register with SGLang's "
                    f"bootstrap server at {url} within {self.config.bootstrap_wait} s ({why}); "
                    "check --disaggregation-bootstrap-port and that the server started")
            time.sleep(min(0.2, self.config.connect_wait))

    def register_room(self, room: int) -> None:
        """Tell the registry which DP rank serves `room` (prefill DP > 1 not following the room)."""
        if self.follow_bootstrap_room or max(self.attn_dp_size, self.system_dp_size) == 1:
            return
        dp = self.system_dp_rank if self.system_dp_size > 1 else self.attn_dp_rank
        self._pool.submit(_http_json, "POST", f"{self._registry()}/register_dp_rank",
                          self.config.connect_wait, {"bootstrap_room": int(room), "dp_rank": dp})

    # -- decode: the prefill's parallel info ------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """True once this prefill's info (and this rank's peer per DP rank) is known; never blocks long."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        with self._lock:
            fut = self._lookups.get(bootstrap_addr)
            if fut is None:
                fut = self._lookups[bootstrap_addr] = self._pool.submit(self._lookup, bootstrap_addr)
        try:
            info = fut.result(timeout=min(_LOOKUP_WAIT_S, self.config.connect_wait))
        except concurrent.futures.TimeoutError:
            return False
        except Exception as exc:  # noqa: BLE001 — SGLang retries, then aborts its requests
            log.warning("pdxfer decode: prefill registry at %s not answering yet: %s", bootstrap_addr, exc)
            with self._lock:
                self._lookups.pop(bootstrap_addr, None)
            return False
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def _lookup(self, bootstrap_addr: str) -> SimpleNamespace:
        """Worker thread: the prefill's parallel info and, per DP rank, our peer's pdxfer address."""
        host, port = parse_address(bootstrap_addr)
        base, wait = f"{self._registry(host, port)}/route", self.config.connect_wait
        query = "prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"
        status, info = _http_json("GET", f"{base}?{query.format(-1, -1, -1, -1)}", wait)
        if status != 200 or not isinstance(info, dict):
            raise TransportError(f"registry answered {status}: {info}")
        refusal = _refusal(info, self)
        prefill_tp = int(info.get("attn_tp_size", 1))
        # per DP rank: [(prefill TP rank, its pdxfer address)] of this rank's replica group
        ranks: dict[int, list[tuple[int, str]]] = {}
        if refusal is None:
            group = source_ranks(prefill_tp, self.attn_tp_size, self.attn_tp_rank)
            for dp in range(int(info.get("dp_size", 1))):
                ranks[dp] = []
                for tp in group:
                    status, rank = _http_json("GET", f"{base}?{query.format(dp, 0, tp, 0)}", wait)
                    if status != 200 or not isinstance(rank, dict):
                        raise TransportError(f"registry has no prefill DP {dp} TP {tp}: {status} {rank}")
                    ranks[dp].append((tp, format_address(str(rank["rank_ip"]), int(rank["rank_port"]))))
        return SimpleNamespace(dp_size=int(info.get("dp_size", 1)),
                               follow_bootstrap_room=bool(info.get("follow_bootstrap_room", True)),
                               attn_tp_size=prefill_tp, ranks=ranks, refusal=refusal)

    # -- requests ------------------------------------------------------------------------
    def indices(self, kv: Any, aux: int | None, states: list | None) -> dict[str, Any]:
        """`{pool: indices}` of one request's pages, aux row and state slots (empty ones left out)."""
        out: dict[str, Any] = {"kv": kv}
        if aux is not None:
            out["aux"] = [aux]
        for pool, idx in zip(self.state_pools, states or [], strict=False):
            out[pool] = idx
        return pool_indices(out)

    # -- decode: SGLang's deferred KV release -------------------------------------------
    def expecting(self, room: Any, parts: list[str]) -> None:
        """Note the engine requests `room` holds on this rank (for `is_abort_release_safe`)."""
        with self._lock:
            self._rooms[room] = list(parts)

    def forget_room(self, room: Any) -> None:
        """`room` has nothing left that can land here (finished, or SGLang let go of it)."""
        with self._lock:
            self._rooms.pop(room, None)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once nothing more can land in this rank's pages of `bootstrap_room`.

        SGLang holds a failed request's pages (on every TP rank, MAX-reduced)
        until each rank says so. pdxfer knows it exactly, without acks: every
        engine request of the room on this rank (one per prefill rank it
        hears from) is finished (Success, or Failed after a fence or at the
        end of a quarantine) or released, or none was ever expected here.
        `required_acks` (SGLang's count of prefill acks) is not needed.
        """
        self.reap()
        with self._lock:
            parts = list(self._rooms.get(bootstrap_room, ()))
        states = [self.engine.try_poll(rid) for rid in parts]
        return all(s is None or s in (KVPoll.Success, KVPoll.Failed) for s in states)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang's hook after a held release: pdxfer keeps no ack tracker; the receiver's clear() releases."""
        self.forget_room(bootstrap_room)

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The executor SGLang's decode runs its prefill DP-rank lookups on (made on first use)."""
        with self._lock:
            if self._prefill_recompute_executor is None:
                self._prefill_recompute_executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4, thread_name_prefix="pdxfer-sglang-dp-query")
            return self._prefill_recompute_executor

    def orphan(self, rid: str) -> None:
        """Keep a request SGLang forgot while it was live, to release it once finished."""
        with self._lock:
            self._orphans.add(rid)
        self.reap()

    def reap(self) -> None:
        """Release the orphans that finished (called from the scheduler's own calls)."""
        with self._lock:
            if not self._orphans:
                return
            orphans = list(self._orphans)
        for rid in orphans:
            state = self.engine.try_poll(rid)
            if state is not None and not state.finished:
                continue
            try:
                if state is not None:
                    self.engine.release(rid)
            except UnknownRequestError:
                pass
            with self._lock:
                self._orphans.discard(rid)

    # -- memory remap -----------------------------------------------------------------------
    def deregister_buffer_to_engine(self) -> None:
        """SGLang's `release_memory_occupation` (KV cache tag): refused where the pools would move.

        With `--enable-memory-saver` SGLang unmaps the KV pools next and maps
        them again, elsewhere, on resume; pdxfer cannot deregister and
        re-register them yet, so its registrations would point at freed
        memory. Raised here, before SGLang pauses anything. Without the memory
        saver the pause is a no-op and the pools stay put: nothing to do.
        """
        if getattr(self.server_args, "enable_memory_saver", False):
            raise ConfigError(
                "release_memory_occupation of the KV cache with pdxfer's SGLang backend: "
                "--enable-memory-saver would move the KV pools, and pdxfer cannot deregister "
                "and re-register them yet; release only the weights (tags=['weights']) or use "
                "another --disaggregation-transfer-backend")

    def register_buffer_to_engine(self) -> None:
        """SGLang's `resume_memory_occupation`: the pools never moved (see the release)."""

    def close(self) -> None:
        """Close the engine and the registry workers; idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._prefill_recompute_executor is not None:
            self._prefill_recompute_executor.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def teardown(self) -> None:
        """SGLang's role-switch hook: release the transfer resources (the pools stay SGLang's)."""
        self.close()


class _Request:
    """What a sender and a receiver share: the ids, the finished outcome, the safe poll.

    A request is one engine request per prefill rank it involves on this
    rank (`parts`): one for a sender, and for a receiver one per prefill rank
    of its replica group (MLA at mixed TP: one that sends the pages, the
    others told there is nothing for them). `rid` is the part that moves the
    bytes. SGLang sees one state: the least advanced part's, Failed only once
    every part is finished (a failed part aborts its siblings first), so no
    byte lands in a page SGLang has freed.
    """

    def __init__(self, mgr: PdxferKVManager, bootstrap_room: int | None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.rid = str(bootstrap_room)  # the sender's own id, a receiver's once its source is known
        self.parts: list[str] = []  # this rank's engine requests of the room
        self.known = False  # the engine holds a record of it (we sent / expected)
        self.local_failure: str | None = None  # failed before the engine knew it
        self.outcome: RequestOutcome | None = None  # the engine's final word, once released
        self._ended: dict[str, RequestOutcome] = {}  # parts released from the engine
        self._siblings_aborted = False

    def _fail_locally(self, reason: str) -> None:
        log.warning("pdxfer %s: request %s failed: %s", self.kv_mgr.mode, self.rid, reason)
        self.local_failure = self.local_failure or reason

    def _live(self) -> list[str]:
        return [rid for rid in self.parts if rid not in self._ended]

    def _engine_poll(self) -> KVPoll:
        """The engine's state, mapped safely; finished parts are released and remembered."""
        if self.outcome is not None:
            return self.outcome.state
        if self.local_failure is not None and not self.known:
            return KVPoll.Failed
        self.kv_mgr.reap()
        engine = self.kv_mgr.engine
        live: list[KVPoll | None] = []
        for rid in self._live():
            state = engine.try_poll(rid)
            if state is not None and state.finished:
                try:
                    self._ended[rid] = engine.release(rid)
                except UnknownRequestError:  # released in between by another caller: keep the state
                    self._ended[rid] = RequestOutcome(state, None, None, None)
            else:
                live.append(state)
        failed = [o for o in self._ended.values() if o.state is KVPoll.Failed]
        if (failed or KVPoll.Quarantined in live) and len(self.parts) > 1:
            self._abort_siblings(failed[0].reason if failed else "quarantined")
        if not live:
            self.outcome = self._combined()
            self.kv_mgr.forget_room(self.bootstrap_room)
            return self.outcome.state
        return min(engine_poll(state) for state in live)

    def _abort_siblings(self, reason: str | None) -> None:
        """One part failed: the others can only fail the request too; stop them now."""
        if self._siblings_aborted:
            return
        self._siblings_aborted = True
        for rid in self._live():
            state = self.kv_mgr.engine.try_poll(rid)
            if state is not None and not state.finished and state is not KVPoll.Quarantined:
                try:
                    self.kv_mgr.engine.abort(rid, f"a sibling transfer of room {self.bootstrap_room} "
                                                  f"failed: {reason or 'failed'}")
                except UnknownRequestError:
                    pass

    def _combined(self) -> RequestOutcome:
        """Every part's outcome as one: Success if all succeeded, else the first failure's."""
        outs = [self._ended[rid] for rid in self.parts]
        main = self._ended.get(self.rid, outs[0])
        bad = [o for o in outs if o.state is not KVPoll.Success]
        if not bad:
            return main
        first = next((o for o in bad if o is main), bad[0])
        return RequestOutcome(KVPoll.Failed, first.reason, first.cause, main.stats)

    def _own_failure(self) -> RequestOutcome | None:
        """The outcome of a part of ours that failed (finished or still draining), if any."""
        for rid in self.parts:
            out = self._ended.get(rid)
            if out is not None and out.state is KVPoll.Failed:
                return out
        for rid in self._live():
            if self.kv_mgr.engine.try_poll(rid) in (KVPoll.Failed, KVPoll.Quarantined):
                return self.kv_mgr.engine.outcome(rid)
        return None

    def failure_exception(self) -> None:
        """Raise why the request failed: pdxfer's `RequestFailed`, its cause attached.

        SGLang reads two attributes from it, as from its own `KVTransferError`:
        `failure_reason`, and `is_from_another_rank`, True when SGLang saw
        Failed (its polls MIN-reduced over the TP group) while this rank's own
        transfer had not failed (it logs those at debug, the failing rank's at
        error).
        """
        if self.local_failure is not None:
            raise _failed(self.rid, self.local_failure, from_another_rank=False)
        out = self._own_failure() if self.known else None
        if out is not None:
            raise _failed(self.rid, out.reason or "failed", from_another_rank=False) from out.cause
        state = self.kv_mgr.engine.try_poll(self.rid) if self.known and self._live() else None
        seen = ("not started" if not self.known else self.outcome.state.name if self.outcome
                else "finished" if state is None else state.name)
        raise _failed(self.rid, f"failed on another {self.kv_mgr.mode} rank (this rank's transfer: "
                                f"{seen})", from_another_rank=True)

    def _abort_parts(self, reason: str) -> bool:
        """Abort every unfinished part; False if the engine knew none of them."""
        told = False
        for rid in self._live():
            try:
                self.kv_mgr.engine.abort(rid, reason)
                told = True
            except UnknownRequestError:
                pass
        return told

    def abort(self) -> None:
        """Give up: Failed once no byte of the request can land any more."""
        if self.outcome is not None:
            return
        why = f"{self.kv_mgr.mode} scheduler aborted the request"
        if not (self.known and self._abort_parts(why)):
            self._fail_locally(why)

    def clear(self) -> None:
        """Forget the request: a live one is aborted (SGLang gave up on it), a finished one released.

        SGLang clears every TP rank's receiver when one rank failed; this
        rank's transfer may still be live then, and nothing would stop its
        prefill writing. The abort makes it Failed once nothing can land; the
        manager releases it when it is (`PdxferKVManager.reap`).
        """
        if self.outcome is not None or not self.known:
            return
        state = self._engine_poll()
        if self.outcome is None:
            self._abort_parts(f"{self.kv_mgr.mode} scheduler released the request (state {state.name})")
            for rid in self._live():
                self.kv_mgr.orphan(rid)
            # SGLang asks nothing more of the room (its deferred release ran before clear())
            self.kv_mgr.forget_room(self.bootstrap_room)


def _failed(rid: str, reason: str, *, from_another_rank: bool) -> RequestFailed:
    exc = RequestFailed(rid, reason)
    exc.failure_reason, exc.is_from_another_rank = reason, from_another_rank
    return exc


class PdxferKVSender(_Request, BaseKVSender):
    """The prefill side of one request: chunks of pages, the last with aux and state."""

    def __init__(self, mgr: PdxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        _Request.__init__(self, mgr, bootstrap_room)
        self.rid = request_id(bootstrap_room, mgr.attn_tp_rank)
        self.parts = [self.rid]
        self.bootstrap_addr = bootstrap_addr
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.created = time.monotonic()
        # Set by SGLang's prefill (`_maybe_send_cached_prefix_kv`) for the next chunk only.
        self._early_send_wait_event: Any = None
        if not req_has_disagg_prefill_dp_rank:
            mgr.register_room(bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """How many pages the request sends in all (the last chunk is the one reaching it), its aux row."""
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Send every non-empty chunk, and the last even with no page: it carries aux and state."""
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: list | None = None,
             num_kv_tokens: int | None = None, indices_event: Any = None, **_: Any) -> None:
        """One `PrefillEngine.send` chunk; a refusal fails this request, not the scheduler.

        The chunk's pages are read once what wrote them is done: SGLang's
        early-send event (`_early_send_wait_event`, recorded on the forward
        stream under overlap scheduling, for this one chunk) or its
        `indices_event`, else the current stream (`PrefillEngine.send(ready=)`).
        """
        ready = self._early_send_wait_event or indices_event
        self._early_send_wait_event = None  # it belongs to exactly one chunk
        if self.outcome is not None or (self.local_failure is not None and not self.known):
            return  # finished (the decode gave up, say): SGLang learns it from poll()
        if self.num_pages is None:
            return self._fail_locally("send() before init(): SGLang sent a chunk before bootstrap")
        self.sent_pages += len(kv_indices)
        # SGLang passes no `last`: its last chunk is the one with state_indices (a list, [] with
        # no state components; None before). Counting pages cannot tell: a chunk that reaches
        # init()'s count may be followed by a zero-page last chunk.
        last = state_indices is not None
        if self.sent_pages > self.num_pages or (last and self.sent_pages != self.num_pages):
            where = "last chunk" if last else "chunk"
            return self._fail(f"{where} brings the pages sent to {self.sent_pages}, but init() "
                              f"announced {self.num_pages}")
        indices = self.kv_mgr.indices(kv_indices, self.aux_index if last else None,
                                      state_indices if last else None)
        try:
            if ready is None:
                self.kv_mgr.engine.send(self.rid, indices, last=last)
            else:
                self.kv_mgr.engine.send(self.rid, indices, last=last, ready=ready)
            self.known = True
        except PdxferError as exc:
            self._fail(f"send refused: {exc}")

    def _fail(self, reason: str) -> None:
        """Fail this request (the engine's record too, if it has one), never the scheduler."""
        self.known = self.kv_mgr.engine.try_poll(self.rid) is not None
        if self.known:
            self.kv_mgr.engine.abort(self.rid, reason)
        else:
            self._fail_locally(reason)

    def poll(self) -> KVPoll:
        """Bootstrapping until the decode's Expect; Failed if none came within request_timeout."""
        state = self._engine_poll()
        if state is KVPoll.Bootstrapping and self.local_failure is None and not self.known:
            waited = time.monotonic() - self.created
            if waited > self.kv_mgr.config.request_wait:
                self._fail_locally(f"no decode expected room {self.rid} within "
                                   f"{self.kv_mgr.config.request_wait} s (request_timeout)")
                return KVPoll.Failed
        if state is not KVPoll.Bootstrapping:
            self.known = True
        return state

    def get_transfer_metric(self) -> Any:
        """Bytes moved and how long it took (pdxfer's `RequestStats`), once known."""
        stats = self.outcome.stats if self.outcome is not None else None
        if stats is None:
            return KVTransferMetric()
        # the time on the wire (SGLang divides the bytes by it for its speed), else the whole span
        return KVTransferMetric(transfer_latency_s=stats.wire_s or stats.elapsed_s,
                                transfer_total_bytes=stats.nbytes)


class PdxferKVReceiver(_Request, BaseKVReceiver):
    """The decode side of one request: resolve the prefill ranks, then expect the pages."""

    def __init__(self, mgr: PdxferKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        _Request.__init__(self, mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_addr: str | None = None  # the prefill rank that sends the pages
        self.sources: list[tuple[str, str]] = []  # (engine request id, prefill address) per rank
        # Read by SGLang's decode queues.
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.require_staging = False

    def _fail_locally(self, reason: str) -> None:
        super()._fail_locally(reason)
        self.conclude_state = KVPoll.Failed

    def init(self, prefill_dp_rank: int) -> None:
        """Find the prefill ranks this decode rank hears from (from the registry lookup)."""
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            return self._fail_locally(f"no parallel info for prefill at {self.bootstrap_addr}")
        if info.refusal is not None:
            return self._fail_locally(info.refusal)
        group = info.ranks.get(int(prefill_dp_rank))
        if not group:
            return self._fail_locally(f"prefill at {self.bootstrap_addr} has no DP rank {prefill_dp_rank}")
        sender = replica_rank([tp for tp, _ in group], int(self.bootstrap_room or 0))
        self.sources = [(request_id(self.bootstrap_room, tp), addr) for tp, addr in group]
        self.rid = request_id(self.bootstrap_room, sender)
        self.prefill_addr = dict(group)[sender]

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: list | None = None, decode_prefix_len: int | None = None,
                      destination: Any = None, **_: Any) -> None:
        """`DecodeEngine.expect` with the destination pages, aux row and state slots.

        A decode radix-cache hit (`decode_prefix_len` tokens, whole pages)
        holds the first pages already: `kv_indices` are the tail's, and the
        Expect says so (`offsets`), so the prefill ships the tail only. The
        other prefill ranks of an MLA replica group are expected too, with
        nothing to send: every entry they would send is skipped, and their
        senders finish once their (empty) last chunk is confirmed.
        """
        if self.local_failure is not None or self.prefill_addr is None:
            return
        page = int(self.kv_mgr.kv_args.page_size)
        prefix = int(decode_prefix_len or 0)
        if prefix % page:
            return self._fail_locally(
                f"decode_prefix_len={prefix} is not a whole number of pages (page_size={page}): "
                "pdxfer ships whole pages; SGLang's radix cache matches whole pages, so this is "
                "a decode bug to report")
        if destination is not None and getattr(destination, "value", destination) != "device":
            return self._fail_locally(f"destination {destination}: pdxfer writes device pools only")
        indices = self.kv_mgr.indices(kv_indices, aux_index, state_indices)
        if prefix:
            indices.setdefault("kv", np.empty(0, np.int64))  # a hit up to the last page: no tail
        held = {"kv": prefix // page} if prefix else {}
        # what an idle prefill rank sends and skips: every entry of every pool
        total = {pool: len(idx) + held.get(pool, 0) for pool, idx in indices.items()}
        engine, parts = self.kv_mgr.engine, []
        self.kv_mgr.expecting(self.bootstrap_room, [rid for rid, _ in self.sources])
        try:
            for rid, addr in self.sources:
                if rid == self.rid:
                    engine.expect(rid, addr, indices, offsets=held or None)
                else:
                    engine.expect(rid, addr, {p: np.empty(0, np.int64) for p in total},
                                  offsets=total)
                parts.append(rid)
        except PdxferError as exc:
            self._fail_locally(f"expect refused: {exc}")
            # the parts already expected can only fail now: aborted, released once finished
            for rid in parts:
                engine.abort(rid, f"a sibling expect was refused: {exc}")
                self.kv_mgr.orphan(rid)
            self.kv_mgr.forget_room(self.bootstrap_room)
            return
        self.parts, self.known = parts, True

    def poll(self) -> KVPoll:
        """WaitingForInput once the prefill rank is known; then the engine's state, safely mapped."""
        if self.known or self.conclude_state is not None:
            return self._engine_poll()
        return KVPoll.WaitingForInput if self.prefill_addr is not None else KVPoll.Bootstrapping

    def abort(self) -> None:
        """Give up (SGLang's AbortReq, a bootstrap failure); with deferred release, hold the pages."""
        super().abort()
        if self.kv_mgr.enable_deferred_decode_kv_release:
            self.abort_notified = True  # the engine heard already: only SGLang's hold to arm

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Stop this rank's transfer and arm SGLang's deferred release of its pages.

        SGLang calls it on every rank of a request that failed anywhere (its
        polls are MIN-reduced), then holds the pages on every rank until each
        rank's manager says `is_abort_release_safe`. Here that is: abort the
        pdxfer requests still live (their prefills hear at once), and set
        `abort_notified`, which makes SGLang hold (the hold is released as
        soon as pdxfer says nothing more can land, often on the next turn).
        """
        if self.known and self.outcome is None:
            for rid in self._live():
                state = self.kv_mgr.engine.try_poll(rid)
                if state is not None and not state.finished and state is not KVPoll.Quarantined:
                    try:
                        self.kv_mgr.engine.abort(rid, f"{self.kv_mgr.mode} scheduler aborted the "
                                                      "request (it failed on this or another rank)")
                    except UnknownRequestError:
                        pass
        if self.kv_mgr.enable_deferred_decode_kv_release:
            self.abort_notified = True

    @property
    def bootstrap_infos(self) -> list[str]:
        """The prefill ranks this receiver reads from (SGLang counts them for its ack hold)."""
        return [addr for _, addr in self.sources]


class PdxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap registry, unchanged: prefill ranks register their pdxfer address.

    Subclassing (not re-implementing) keeps every router and the Rust
    registry, which stands in only for `CommonKVBootstrapServer` subclasses,
    working with pdxfer; see the module docstring.
    """

    def __init__(self, host: str, port: int) -> None:
        _require_sglang()
        super().__init__(host, port)


_registered = False
CLASSES = {"manager": PdxferKVManager, "sender": PdxferKVSender, "receiver": PdxferKVReceiver,
           "bootstrap_server": PdxferKVBootstrapServer}


def register() -> None:
    """`sglang.srt.plugins` entry point: `--disaggregation-transfer-backend pdxfer` resolves here.

    Three hooks, no patch: the CLI choice, a `TransferBackend` enum that also
    has `PDXFER` (SGLang parses the flag with `TransferBackend(value)`), and
    `get_kv_class` wrapped to return this module's classes for it. Idempotent.
    """
    global _registered
    _require_sglang()
    if _registered:
        return
    _registered = True
    import sglang.srt.disaggregation.utils as U
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    members = {m.name: m.value for m in U.TransferBackend}
    if NAME.upper() not in members:
        members[NAME.upper()] = NAME
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend",
                              enum.Enum("TransferBackend", members, module=U.__name__),
                              HookType.REPLACE)

    def get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
        if getattr(transfer_backend, "value", None) == NAME and class_type.value in CLASSES:
            return CLASSES[class_type.value]
        return original(transfer_backend, class_type)

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class,
                          HookType.AROUND)
