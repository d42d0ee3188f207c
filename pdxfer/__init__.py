"""The PD engine: a prefill sender and a decode receiver for disaggregated serving.

What a serving engine links into its workers, in a page of code:

    from pdxfer import PrefillEngine, DecodeEngine, EngineConfig, KVPoll

    cfg = EngineConfig(transport="tcp", timeout=10.0)
    prefill = PrefillEngine({"kv": kv_arena, "state": state_arena}, cfg)
    # publish prefill.bootstrap_address to the router
    decode = DecodeEngine({"kv": kv_arena, "state": state_arena}, cfg)
    decode.expect(rid, prefill_addr, {"kv": dst_pages, "state": [dst_slot]})
    prefill.send(rid, {"kv": src_pages, "state": [src_slot]})   # after the forward pass
    decode.poll(rid) == KVPoll.Success                           # poll from the scheduler loop

Both engines register each allocation once at start-up, describe their pools
in the handshake (refusing a layout mismatch with the pool and field named),
and ship one transfer per pool per request, planned by `layout`. A page pool
and a state pool carved from one allocation (`layout.ElasticPools`) can move
their boundary under traffic (`engine.resize`). When prefill
and decode run different TP sizes, each rank's engine serves shard-major pools
and `HeteroTPPrefill`/`HeteroTPDecode` split a request into rank pairs.

The names below are imported on first use, not with the package: every
`pdxfer.*` module — the CLI's too — imports this package first, and the
engine pulls in torch, so `pdxfer --version` and `--help` would otherwise
wait a second or more for nothing (`tests/pdxfer/test_cli.py` checks that
they import no torch). `from pdxfer import PrefillEngine` works as before.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module of this package that defines it
_EXPORTS = {
    "EngineConfig": "config", "KVPoll": "config", "RequestStats": "config",
    "DecodeEngine": "decode",
    "BoundsError": "errors", "CapabilityError": "errors", "ClosedError": "errors",
    "ConfigError": "errors", "LayoutError": "errors", "LayoutMismatchError": "errors",
    "PdxferError": "errors", "PeerLostError": "errors", "ProtocolError": "errors",
    "RegistrationError": "errors", "RequestError": "errors", "RequestFailed": "errors",
    "ResizeBlockedError": "errors", "TransferTimeout": "errors", "TransportError": "errors", "UnknownRequestError": "errors",
    "PrefillEngine": "prefill",
    "RequestOutcome": "requests",
    "ResizeReport": "resizing",
    "HeteroTPDecode": "tp_group", "HeteroTPPrefill": "tp_group", "group_address": "tp_group",
    "sub_request_id": "tp_group",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is asked for (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
