"""The nixl backend: UCX through NVIDIA NIXL, on the kit.

Files, one topic each: `engine.py` (the engine: initiating agent, listener,
links, the tls policy's capabilities), `send.py` (the sending link: the
peer's agent and regions, descriptors), `inbound.py` (an inbound link: the
agent serving one sender, its fence), `requests.py` (the queue of NIXL
requests the progress thread posts and polls), `progress.py` (the one
polling loop), `agent.py` (the edge with NIXL: agents, the UCX transport
policy, errors), `wire.py` (control frames, the notification).
"""

from .engine import NixlEngine

__all__ = ["NixlEngine"]
