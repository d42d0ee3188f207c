"""The ucx backend: UCX through UCXX (`ucxx-cu12`), the maintained successor of ucx-py.

UCXX's Python API is two-sided — endpoints, tag messages, no RMA — so a
write is announced on the link's control connection and moved as one tag
message per run: the receiver posts a receive straight into each
destination run, the sender sends straight from each source run, tag
`(transfer, run)`, and the notify follows the last run (`send.py`,
`inbound.py`). UCX's protocols do the zero-copy underneath (its rendezvous
reads or writes the run in place where the transport allows).

Files, one topic each: `engine.py` (the engine on the kit), `send.py` (the
sending link), `inbound.py` (a receiving link and its fence), `progress.py`
(the one thread that calls UCX), `wire.py` (control frames), `lib.py` (the
UCXX edge: import, contexts, tags, buffers, errors).

**The fence, as measured** (benchmarks/ucx_fence_probe.py: one 16 MiB tag
message between two processes, fenced half-way; docs/reliability.md has the
table):

* Cancelling and closing an endpoint is not a fence. `ucp_request_cancel`
  removes only receives not yet matched; a matched one keeps filling. And
  UCX's tcp transport keeps *reading* a connection whose local endpoint was
  closed ("remove TX capability, but still will be able to receive data",
  `uct_tcp_ep_destroy`). A receiver that keeps its worker progressing — as
  one worker shared by all peers must — saw 9–13 MB of a 16 MB message land
  after the fence, over tcp and over UCX's default list, with every
  rendezvous scheme and with eager only.
* Retiring a worker that serves one link alone *is* a fence wherever every
  byte is written by our own progress: tcp (all protocols), shared-memory
  eager, cma with the receiver reading (`RNDV_SCHEME=get_zcopy`, UCX's
  choice by default). Zero bytes landed after it in every such case.
* It is not where the sender writes: with `RNDV_SCHEME=put_zcopy` over cma
  the sender's `process_vm_writev` landed the whole 16 MiB after the
  receiver had closed the endpoint and retired the worker. GPU copies
  (cuda_ipc/cuda_copy) run on after the worker is gone as well; not
  measured here (no GPU), so not claimed.
* Peer error handling — without which a sender dying between its
  rendezvous request and our read aborts the *receiving* process (measured:
  SIGABRT from `process_vm_readv ... No such process` in cma_ep.c) — keeps,
  for tag messages, only transports that can report a dead peer: on one host
  without a GPU, tcp alone, even with UCX's full list (`UCX_PROTO_INFO=y`
  on two `ucx-all` processes). NIXL's RMA puts do go over cma under the
  same setting (its gpu-check test): UCX decides this per protocol.

So: `tls="tcp"` (the default), one UCX worker per inbound link, the fence
retires it (`capabilities.fence` True, pinned by
tests/transport/test_ucx.py with bytes in flight); `tls="all"` declares
`fence=False` and the engine quarantines instead. Cost of the fence: a
link fenced while a receive of it was under way leaves its worker
allocated (UCXX holds a worker through a matched receive; nothing can free
it without progressing it) — `engine.abandoned_workers` counts them.

What the UCXX wheel is not: its bundled UCX (libucx-cu12 1.21) is built
`--without-verbs --without-rdmacm`, so this backend has no InfiniBand/RoCE
path unless a system UCX is preferred (`RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`);
for RDMA use `verbs` or `nixl`.
"""

from .engine import UcxEngine

__all__ = ["UcxEngine"]
