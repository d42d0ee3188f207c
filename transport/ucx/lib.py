"""The one place that touches UCXX: importing it cleanly, contexts and workers, tags, buffers, errors.

Importing UCXX has side effects we undo here. `ucxx/__init__` (0.52) writes
`UCX_MEMTYPE_CACHE`, `UCX_RNDV_THRESH=8192`, `UCX_RNDV_FRAG_MEM_TYPE=cuda` and
`UCX_MAX_RNDV_RAILS=1` into `os.environ` when absent — process-wide, so every
UCX context created afterwards would read them, NIXL's (which bundles its own
UCX) included. We import UCXX with the `UCX_*` environment saved and put it
back right after; what our own contexts need goes in as context options
(`context`), never through the environment. The one variable we do set is
UCX's log destination (`ucxenv.route_ucx_log`): libucs reads it when it
loads, which is this import.

Measured traps of UCXX's Python API that shape the backend (0.52):

* a request does not keep its buffer alive: a temporary array handed to
  `tag_send` was freed while UCX read it (garbage received, then a segfault).
  Every posted run here is a view of a registered region, and the post's
  record holds that region until the request completes.
* `Endpoint.close()` (the request form) on an endpoint whose peer died,
  then progress: segfault. Only `close_blocking()` is used, and only with
  peer error handling on, where it is a bounded force-close — and only on
  an endpoint still `alive` (`close_endpoint`): three full-suite runs here
  segfaulted inside `close_blocking()` or the next `progress()` after a
  link died mid-handshake, the double-close class of UCXX bug
  (rapidsai/ucxx#184). An endpoint UCX already failed was closed by its
  error handling; dropping it (on the UCX thread: `Progress.own`) is all
  that is left. The crashes that hunt still saw (about 1 run in 400: a
  SIGABRT in UCX's tcp transport during `progress()`, SIGSEGVs in
  `close_blocking()`) were one UCX bug, forced every run by
  `benchmarks/ucx_tcp_abort_repro.py` and avoided by non-blocking tcp
  connects (`context`).
* no per-request cancel. Closing an endpoint cancels the receives posted on
  it that are not yet matched (UCX's `ucp_request_cancel`);
  `Worker.cancel_inflight_requests()` cancels only what UCXX scheduled after
  an endpoint error — a receive posted on the worker stays posted, and a
  matched receive keeps its worker alive (UCXX holds the worker through
  every request). Why receives are posted on an endpoint and the fence
  retires a whole per-link worker: the package docstring.
* destroying a worker first receives every unexpected message, progressing
  until each completes — forever, for a rendezvous from a stalled sender.
  `release_worker` takes them off the unexpected queue first.

Tags. One UCX worker serves one inbound link, so a tag only has to be unique
within a link: transfer sequence number above `RUN_BITS`, run index below.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from ..errors import ClosedError, PeerLostError, ProtocolError, TransportError
from ..ucxenv import route_ucx_log

route_ucx_log()
_saved_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
try:
    from ucxx._lib import libucxx as ucx  # noqa: E402  (runs ucxx/__init__: the env writes)
    from ucxx._lib.arr import Array  # noqa: E402
finally:
    for _key in [k for k in os.environ if k.startswith("UCX_") and k not in _saved_env]:
        del os.environ[_key]
    os.environ.update(_saved_env)

VERSION = ".".join(map(str, ucx.get_ucx_version()))  # the UCX under UCXX, e.g. "1.21.0"

RUN_BITS = 20
MAX_RUNS = 1 << RUN_BITS  # runs (coalesced rows) per transfer
MAX_SEQ = 1 << (64 - RUN_BITS)
# A worker address's bounds (`check_address`): UCX 1.21's tcp-only address is 52 B here; the
# upper bound leaves room for many devices and still fits the 4 KiB handshake frame.
MIN_ADDRESS = 16
MAX_ADDRESS = 2048
ADDRESS_SUM_BYTES = 16
ADDRESS_PAD = 4096  # zero bytes after the address UCX parses (`endpoint`)
FULL_TLS = "all"
TLS_CHOICES = ("tcp", FULL_TLS)


def tag(seq: int, run: int) -> Any:
    """The UCX tag of run `run` of transfer `seq` on its link."""
    return ucx.UCXXTag((seq << RUN_BITS) | run)


def context(tls: str, device: str | None) -> Any:
    """A UCX context for tag messages with wake-up support, restricted to `tls` (and `device`).

    `tls="tcp"`: UCX's tcp transport only; `"all"`: UCX's own full list.
    `device` (a network interface) becomes `NET_DEVICES`. Peer error
    handling (asked per endpoint) then keeps only the transports that can
    report a dead peer — on one host without a GPU that is tcp alone, even
    for "all" (measured: UCX drops sysv/posix/cma; see docs/reliability.md).

    Eager protocols only, unless UCX found a CUDA transport: UCX 1.21
    segfaults when a peer dies during a rendezvous and no transport keeps a
    registration cache (`ucs_rcache_region_invalidate(rcache=NULL)` from
    `ucp_proto_rndv_rtr_abort`, seen here in the engine's SIGKILL test;
    openucx/ucx#11467, fixed after 1.21.0 by #11485) — the case with tcp,
    shared memory and cma. Deletion condition: the bundled UCX is 1.22 or
    newer. With a CUDA transport rendezvous is kept: it is what moves GPU
    memory without a bounce (whether that context keeps a cache, so that the
    crash cannot happen there, is unverified: no GPU here).

    tcp connects without blocking (`TCP_CONN_NB=y`; UCX's default is a
    blocking `connect`). UCX 1.21's tcp transport kills the process when a
    peer that had already connected to one of our workers dies before that
    worker's own endpoint to it is set up: the new endpoint takes over the
    peer's socket, its connection request fails (reset), it reconnects, and
    a blocking connect is refused at once — inside `uct_tcp_ep_connect`,
    before the endpoint has its send side, so tcp schedules it for
    destruction as a receive-only endpoint of its own while UCP goes on
    using it. The next `progress()` frees it: SIGABRT if a send is queued on
    it (`uct_tcp_ep_pending_purge`), else a SIGSEGV when UCP touches it next
    (`close_blocking`). A non-blocking connect reports the refusal from
    progress instead, once the endpoint can send, where tcp hands it to
    UCP's error handling: the endpoint fails and nothing dies
    (`benchmarks/ucx_tcp_abort_repro.py`, docs/reliability.md). Deletion
    condition: a UCX whose `uct_tcp_ep_create_socket_and_connect` does not
    call `uct_tcp_ep_set_failed` on an endpoint without its send side.
    """
    config: dict[str, str] = dict(TCP_CONN_NB="y")  # see below
    if tls != FULL_TLS:
        config.update(TLS=tls, RNDV_THRESH="inf")  # tcp alone: no CUDA transport
    if device:
        config["NET_DEVICES"] = device
    what = f"starting UCX with transports {tls!r}" + (f" on interface {device!r}" if device else "")
    try:
        ctx = ucx.UCXContext(config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        # `cuda_support` says only that CUDA transports were asked for; the resource list
        # says whether UCX found one (a GPU and its driver)
        if "RNDV_THRESH" in config or "cuda" in ctx.info:
            return ctx
        del ctx
        return ucx.UCXContext({**config, "RNDV_THRESH": "inf"},
                              feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    except Exception as exc:
        raise translate(exc, what) from exc


def worker(ctx: Any) -> Any:
    """A worker of `ctx` in blocking progress mode (its epoll descriptor wakes our thread)."""
    w = ucx.UCXWorker(ctx)
    w.init_blocking_progress_mode()
    return w


def worker_address(w: Any) -> bytes:
    """The packed UCX address of `w` (what the peer's `endpoint` parses)."""
    return bytes(w.address)



def address_sum(address: bytes) -> bytes:
    """The checksum a side sends beside its worker address (`Hello.worker_sum`, `Welcome.worker_sum`)."""
    return hashlib.blake2b(address, digest_size=ADDRESS_SUM_BYTES).digest()


def check_address(address: bytes, checksum: bytes, own: bytes, what: str) -> None:
    """`ProtocolError` naming the field unless `address` is a worker address UCX may be handed.

    Run on the thread that read the frame, before the address goes near
    UCX: UCX's address parser takes a pointer, not a length, so an address
    that claims more than it holds is read past its end (measured: a
    truncated address segfaulted the process within 27–85 tries; a
    corrupted length byte does the same). Three checks, cheapest first:
    the length within `MIN_ADDRESS..MAX_ADDRESS`; the sender's checksum of
    the bytes it packed (`address_sum`: any flipped, dropped or added byte
    is refused here, never parsed); the header's format version against that
    of `own`, one of our workers' addresses (an unknown version aborts the process:
    `ucs_assertv_always(addr_version == V2)`, address.c). What a peer that
    computes a valid checksum over a malformed address can still reach is
    UCX's parser over a zero-padded copy (`endpoint`).
    """
    if not MIN_ADDRESS <= len(address) <= MAX_ADDRESS:
        raise ProtocolError(
            f"{what}: its UCX worker address is {len(address)} B, outside "
            f"{MIN_ADDRESS}..{MAX_ADDRESS} B (field worker); both sides must run pdxfer's ucx backend")
    if not hmac.compare_digest(address_sum(address), checksum):
        raise ProtocolError(
            f"{what}: its UCX worker address ({len(address)} B) does not match its checksum "
            f"(field worker_sum: {checksum.hex() or 'empty'}, the address sums to "
            f"{address_sum(address).hex()}); the frame was corrupted or forged — refused unparsed")
    if (address[0] & 0x0F) != (own[0] & 0x0F):
        raise ProtocolError(
            f"{what}: its UCX worker address (header {address[:1].hex()}, field worker) is not in "
            f"this UCX's format (header {own[:1].hex()}); both sides must run the same UCX "
            f"(here {VERSION})")


def endpoint(w: Any, address: bytes) -> Any:
    """An endpoint of `w` to the worker at `address` (passed `check_address`), with peer error handling.

    UCX is handed a copy followed by `ADDRESS_PAD` zero bytes: its parser
    has no length, and a read past what the peer sent then stays inside
    memory we own and zeroed (measured: truncated addresses, 1,200 tries with
    the padding, no crash; without it, a segfault within 27–85).
    """
    try:
        peer = ucx.UCXAddress.create_from_buffer(address + bytes(ADDRESS_PAD))
        return ucx.UCXEndpoint.create_from_worker_address(w, peer, True)
    except Exception as exc:
        raise translate(exc, "connecting a UCX endpoint") from exc


class CudaSpan:
    """`nbytes` of device memory at `ptr`, in the form UCXX's `Array` takes for CUDA buffers."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3, "strides": None}


def close_endpoint(ep: Any) -> None:
    """Force-close `ep` (progress thread) unless UCX's error handling already closed it (above).

    Cancels its unmatched receives and fails its sends still in flight.
    """
    if ep.alive:
        ep.close_blocking()


def buffer(region: Any, offset: int, nbytes: int) -> Any:
    """`Array` over bytes `[offset, offset + nbytes)` of a registered region (host or CUDA)."""
    if region.view is not None:
        return Array(region.view[offset:offset + nbytes])
    return Array(CudaSpan(region.start + offset, nbytes))


def release_worker(w: Any) -> None:
    """Drop every unexpected message of `w` (progress thread), so destroying it never waits.

    After this, dropping the last reference destroys the worker without
    progressing it — unless a receive of it is still under way (its endpoint
    was closed, so only a matched one can be), which keeps it alive and
    unprogressed (abandoned) for good.
    """
    w.cancel_inflight_requests()  # only what UCXX scheduled for cancelling (an endpoint's errors)
    anything = ucx.UCXXTag(0)
    mask = ucx.UCXXTagMask(0)
    for _ in range(1 << 20):  # bounded: each call takes one message off a finite queue
        if not w.tag_probe(anything, mask, True).matched:
            break


def status(req: Any) -> Exception | None:
    """The UCXX error a completed request ended with, or None."""
    try:
        req.check_error()
    except Exception as exc:  # UCXX's classes; `translate` maps them
        return exc
    return None


def translate(exc: BaseException, what: str) -> TransportError:
    """Our error for a UCXX exception raised while doing `what` (raise it `from exc`).

    Its `__cause__` is set here too: a link severed with it (not raised) keeps the cause.
    """
    if isinstance(exc, TransportError):
        return exc
    out = _translate(exc, what)
    out.__cause__ = exc
    return out


def _translate(exc: BaseException, what: str) -> TransportError:
    if isinstance(exc, (ucx.UCXConnectionResetError, ucx.UCXEndpointTimeoutError,
                        ucx.UCXUnreachableError, ucx.UCXNotConnectedError, ucx.UCXRejectedError)):
        return PeerLostError(f"{what}: the peer is gone ({type(exc).__name__}: {exc})")
    if isinstance(exc, ucx.UCXCanceledError):
        return ClosedError(f"{what}: cancelled (the link was closed or fenced)")
    if isinstance(exc, ucx.UCXMessageTruncatedError):
        return ProtocolError(f"{what}: the peer sent more bytes than the run it announced ({exc})")
    return TransportError(f"{what} failed in UCX: {type(exc).__name__}: {exc}")
