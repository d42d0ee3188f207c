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
"""

from .config import EngineConfig, KVPoll, RequestStats
from .decode import DecodeEngine
from .errors import (
    BoundsError,
    CapabilityError,
    ClosedError,
    ConfigError,
    LayoutError,
    LayoutMismatchError,
    PdxferError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    RequestError,
    RequestFailed,
    ResizeBlockedError,
    TransferTimeout,
    TransportError,
    UnknownRequestError,
)
from .prefill import PrefillEngine
from .requests import RequestOutcome
from .resizing import ResizeReport
from .tp_group import HeteroTPDecode, HeteroTPPrefill, group_address, sub_request_id

__all__ = [
    "BoundsError",
    "CapabilityError",
    "ClosedError",
    "ConfigError",
    "DecodeEngine",
    "EngineConfig",
    "HeteroTPDecode",
    "HeteroTPPrefill",
    "KVPoll",
    "LayoutError",
    "LayoutMismatchError",
    "PdxferError",
    "PeerLostError",
    "PrefillEngine",
    "ProtocolError",
    "RegistrationError",
    "RequestError",
    "RequestFailed",
    "RequestOutcome",
    "RequestStats",
    "ResizeBlockedError",
    "ResizeReport",
    "TransferTimeout",
    "TransportError",
    "UnknownRequestError",
    "group_address",
    "sub_request_id",
]
