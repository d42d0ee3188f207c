"""The verbs backend: RDMA WRITEs on RC QPs through pyverbs, on the kit.

Files, one topic each: `engine.py` (the engine: device, per-region MRs,
listener, links), `send.py` (the sending link: QPs, WR windows, credits),
`inbound.py` (an inbound link: QPs, receive slots, per-link MRs, the fence),
`progress.py` (the one CQ-polling thread), `device.py` (the narrow view of
the device links get), `build.py` (every pyverbs object and the WR plan),
`mem.py` (registering host and CUDA memory), `api.py` (real pyverbs under
one name set; ports; completion errors), `wire.py` (control frames, the
note), `hw.py` (the registry's probe for a real port), and `sim/` (the
software fabric, "verbs-sim").
"""

from .engine import VerbsEngine

__all__ = ["VerbsEngine"]
