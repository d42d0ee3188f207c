"""Can bytes still land in a receive after we "fence" its sender? Asked of UCX itself, with real bytes.

The `ucx` backend's `drop_peer` must guarantee that no byte of the dropped
peer's earlier writes lands after it returns. UCXX (the Python API over UCX)
is two-sided: the receiver posts tag receives straight into its memory. This
probe puts one large tag message in flight between two processes and fences
the receive half-way, in two ways, under each UCX configuration asked for:

- `endpoint`: cancel the receive and close (force) the endpoint to the
  sender, and keep progressing the worker — what a receiver with ONE worker
  shared by all its peers has to do, since it keeps serving the others;
- `worker`: the same, then release the worker and never progress it again —
  what a receiver with one worker PER inbound link can do.

The sender is held still while the receiver matches the message and fences
(it is told to pause the moment its first packet arrived) and resumes after
the fence; then the receiver counts the bytes of its buffer that changed after
its fence returned. Both step their workers one `progress_once` at a time until
the pause: UCXX's `progress()` drains all that arrives, and a receiver looking
for the first packet with it once took in the whole message while the sender
kept sending — nothing was left in flight at the fence. Stepped, the sender
gets at most the socket buffers (capped at `SOCKET_BUFFER` over tcp: this
host's autotuning lets one loopback connection buffer 36 MiB) and one step's
read ahead of the pause; `sent_at_pause` says if it finished anyway.
Everything is ordered by messages on a pipe, not sleeps; the sender's run
after the fence ends when its send does, bounded by `--run-after`.

    .venv/bin/python benchmarks/ucx_fence_probe.py --mib 16
    .venv/bin/python benchmarks/ucx_fence_probe.py --tls tcp --scheme auto --fence worker --mib 4
    UCX_PROTO_INFO=y .venv/bin/python benchmarks/ucx_fence_probe.py ...   # which protocol carried it

Prints one line per case (JSON with `--json`). The finding and what the
backend does with it: `transport/ucx/__init__.py` and docs/reliability.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

TAG = 0x5EED  # the probe's message
WIREUP = 0x5EEE  # one small exchange first, so the endpoints are wired before we measure
SOCKET_BUFFER = "1m"  # each tcp socket's kernel buffers (UCX's TCP_SNDBUF/TCP_RCVBUF)


@dataclass(frozen=True)
class Case:
    """One configuration: UCX transports, rendezvous scheme and threshold, and the fence tried."""

    tls: str  # "tcp" or "all" (UCX's default list: shared memory, cma, tcp on one host)
    scheme: str  # UCX_RNDV_SCHEME: put_zcopy, get_zcopy, auto
    thresh: str  # UCX_RNDV_THRESH: where rendezvous starts ("inf": eager only)
    fence: str  # "endpoint" or "worker"
    nbytes: int

    def config(self) -> dict[str, str]:
        """The UCX context options (passed to UCXX, never through the environment)."""
        cfg = {"RNDV_SCHEME": self.scheme, "RNDV_THRESH": self.thresh}
        if self.tls == "tcp":
            cfg.update(TLS="tcp", NET_DEVICES="lo", TCP_SNDBUF=SOCKET_BUFFER,
                       TCP_RCVBUF=SOCKET_BUFFER)
        return cfg

    @property
    def error_handling(self) -> bool:
        # UCX's peer error handling is only offered by tcp here: asking for it on the
        # full list quietly leaves tcp alone (shared memory and cma cannot report a dead peer)
        return self.tls == "tcp"


@dataclass
class Outcome:
    """What the receiver saw: bytes landed at the fence and after it, and the send's end.

    `sent_at_pause`: whether the sender's request had completed when it paused
    (then nothing was in flight at the fence: the case proves nothing).
    """

    landed_at_fence: int
    landed_after: int
    recv_status: str
    send_status: str
    worker_released: bool | None
    fence_s: float
    sent_at_pause: bool

    @property
    def leaked(self) -> int:
        return self.landed_after - self.landed_at_fence


def _ucxx() -> tuple[Any, Any]:
    from ucxx._lib import libucxx as ucx
    from ucxx._lib.arr import Array

    return ucx, Array


def _worker(config: dict[str, str]) -> tuple[Any, Any, Any, Any]:
    ucx, array = _ucxx()
    ctx = ucx.UCXContext(config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    return ucx, array, ctx, ucx.UCXWorker(ctx)


def _status(req: Any) -> str:
    if not req.completed:
        return "in progress"
    try:
        req.check_error()
    except Exception as exc:  # UCXX's own exception classes: only their names matter here
        return type(exc).__name__
    return "ok"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wire(ucx: Any, array: Any, worker: Any, ep: Any) -> None:
    out, back = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    reqs = [ep.tag_send(array(out), ucx.UCXXTag(WIREUP)), ep.tag_recv(array(back), ucx.UCXXTag(WIREUP))]
    deadline = time.monotonic() + 30
    while not all(r.completed for r in reqs):
        if time.monotonic() > deadline:
            raise TimeoutError("wire-up exchange did not complete in 30 s")
        worker.progress()


def sender(pipe: Connection, case: Case, run_after: float) -> None:
    """The peer: send one message, pause when told, resume after the fence (<= `run_after` s)."""
    ucx, array, _ctx, worker = _worker(case.config())
    pipe.send(bytes(worker.address))
    peer = ucx.UCXAddress.create_from_buffer(pipe.recv())
    ep = ucx.UCXEndpoint.create_from_worker_address(worker, peer, case.error_handling)
    _wire(ucx, array, worker, ep)
    src = np.full(case.nbytes, 0xAB, dtype=np.uint8)
    assert pipe.recv() == "send"
    req = ep.tag_send(array(src), ucx.UCXXTag(TAG))
    while not pipe.poll():  # until the receiver saw our first packet
        worker.progress_once()
    assert pipe.recv() == "pause"
    pipe.send(("paused", req.completed))
    assert pipe.recv() == "resume"
    deadline = time.monotonic() + run_after
    while time.monotonic() < deadline and not req.completed:
        worker.progress()
    pipe.send(_status(req))
    pipe.recv()  # "bye": keep the process (and its memory) until the receiver has counted


def receiver(pipe: Connection, case: Case, out: Any) -> None:
    """Post a receive, match the message, fence half-way, count what lands afterwards."""
    ucx, array, ctx, worker = _worker(case.config())
    peer = ucx.UCXAddress.create_from_buffer(pipe.recv())
    pipe.send(bytes(worker.address))
    ep = ucx.UCXEndpoint.create_from_worker_address(worker, peer, case.error_handling)
    _wire(ucx, array, worker, ep)
    buf = np.zeros(case.nbytes, dtype=np.uint8)
    pipe.send("send")
    deadline = time.monotonic() + 30
    while not worker.tag_probe(ucx.UCXXTag(TAG)).matched:  # its first packet is here
        if time.monotonic() > deadline:
            raise TimeoutError("the probe message did not arrive in 30 s")
        worker.progress_once()
    pipe.send("pause")
    said, sent_at_pause = pipe.recv()
    assert said == "paused"
    req = ep.tag_recv(array(buf), ucx.UCXXTag(TAG))
    # Let the match take effect: rendezvous answers go out, buffered eager data lands.
    for _ in range(200):
        worker.progress()
        if req.completed:
            break
    fds = _open_fds()
    started = time.perf_counter()
    ep.close_blocking()  # cancels what is unmatched, then closes (force with error handling)
    released: bool | None = None
    if case.fence == "worker":
        worker.cancel_inflight_requests()
        recv_status = _status(req)
        del req, ep, ctx  # the context too: nothing of ours may keep the worker
        worker = None
        gc.collect()
        released = _open_fds() < fds  # its sockets/shared memory went with it
    fence_s = time.perf_counter() - started
    at_fence = int(np.count_nonzero(buf))
    pipe.send("resume")
    while not pipe.poll():
        if worker is not None:
            worker.progress()  # a shared worker keeps serving its other peers
        else:
            pipe.poll(1.0)  # a retired worker is never progressed: wait for the sender
    send_status = pipe.recv()
    if case.fence == "endpoint":
        # what the sender handed its socket before it finished lands too (bounded)
        deadline = time.monotonic() + 5
        while not req.completed and time.monotonic() < deadline:
            worker.progress()
        recv_status = _status(req)
    after = int(np.count_nonzero(buf))
    pipe.send("bye")
    out.put(asdict(Outcome(at_fence, after, recv_status, send_status, released, round(fence_s, 4),
                           sent_at_pause)))


def probe(case: Case, run_after: float = 1.0, timeout: float = 90.0) -> Outcome:
    """Run one case in two fresh processes and return what the receiver saw."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(b, case, out), daemon=True),
             ctx.Process(target=sender, args=(a, case, run_after), daemon=True)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return Outcome(**out.get(timeout=0.2))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"probe {case} gave no answer (exit codes "
                                       f"{[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tls", default="tcp,all")
    parser.add_argument("--scheme", default="put_zcopy,get_zcopy,auto")
    parser.add_argument("--thresh", default="8192,inf")
    parser.add_argument("--fence", default="endpoint,worker")
    parser.add_argument("--mib", type=int, default=16, help="message size")
    parser.add_argument("--run-after", type=float, default=1.0,
                        help="seconds the sender may keep progressing after the fence (it "
                             "stops once its send ended)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="4 MiB messages and a 0.3 s run after the fence (the docs test's size)")
    args = parser.parse_args()
    if args.tiny:
        args.mib, args.run_after = 4, 0.3
    for tls in args.tls.split(","):
        for scheme in args.scheme.split(","):
            for thresh in args.thresh.split(","):
                for fence in args.fence.split(","):
                    case = Case(tls, scheme, thresh, fence, args.mib << 20)
                    outcome = probe(case, args.run_after)
                    row = {**asdict(case), **asdict(outcome), "leaked": outcome.leaked}
                    if args.json:
                        print(json.dumps(row), flush=True)
                    else:
                        print(f"tls={tls:<4} scheme={scheme:<9} thresh={thresh:<5} fence={fence:<8} "
                              f"at_fence={outcome.landed_at_fence:>9} leaked={outcome.leaked:>9} "
                              f"recv={outcome.recv_status:<18} send={outcome.send_status:<18} "
                              f"released={outcome.worker_released}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
