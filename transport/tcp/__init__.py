"""The tcp backend: striped TCP streams straight from and into registered memory.

Files, one topic each: `engine.py` (the engine on the kit: listener,
inbound streams, outbound links, bounce buffers), `send.py` (the sending
link: stripes, writer and ack threads), `recv.py` (an inbound stream:
header checks, landing in place, stripe accounting), `io.py` (vectored
send/recv loops, striping, batching, the bounce buffers), `wire.py` (the
frames a stream carries).
"""

from .engine import TcpEngine

__all__ = ["TcpEngine"]
