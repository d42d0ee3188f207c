"""`pdxfer bench chunked`: how much of a request's transfer chunked prefill hides behind compute.

A prefill that computes a long prompt in chunks can `send(..., last=False)`
each chunk's pages as soon as that chunk's forward pass wrote them, so the
transfer runs while the next chunk computes. What the decode waits for is
then only what was not hidden: the time from the last chunk computed to the
decode's Success. Per backend, one request of `--pages` KV pages (64 KiB
each, scattered) plus one state entry, split into `--chunks` chunks, each
"computed" by a timed busy section of `--compute-ms` (numpy matmuls on the
prefill's thread, GIL released inside them, standing in for the forward
pass), in three modes taking turns:

- `chunked`: compute chunk k, send its pages (`last=False`; the state entry
  rides the last chunk, `last=True`);
- `after`: compute every chunk, then send everything in one `send`;
- `transfer only`: no compute; the time from `send` to Success is the
  transfer the other two could hide.

`exposed ms` is the median time from the end of the last compute to the
decode's Success (monotonic clock, system-wide, so it crosses processes);
`hidden` = 1 - exposed(chunked) / exposed(after). Every request's landed
entries are compared by crc32 with the source's. With `--processes 2` the
decode engine runs in a child process (`bench/decode_peer.py`), as deployed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from ..cliargs import bounded_float, bounded_int
from ..config import EngineConfig, KVPoll
from ..errors import UnknownRequestError
from ..prefill import PrefillEngine
from . import report as br
from . import workload
from .decode_peer import LocalDecode, entries_crc
from .peer import CHILD_NOTE, ChildPeer, crosses_processes

MODES = ("chunked", "after", "transfer only")
_A = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)


def compute(seconds: float) -> None:
    """Busy the calling thread for `seconds` with small matmuls (the GIL is released inside each)."""
    end = time.perf_counter() + seconds
    a = _A
    while time.perf_counter() < end:
        a = np.tanh(a @ _A)


def _request(rng: np.random.Generator, pages: int, kv_n: int, st_n: int) -> tuple[dict, dict]:
    src = {"kv": rng.permutation(kv_n)[:pages], "state": np.array([int(rng.integers(st_n))])}
    dst = {"kv": rng.permutation(kv_n)[:pages], "state": np.array([int(rng.integers(st_n))])}
    return src, dst


def _one(prefill: PrefillEngine, decode, rid: str, mode: str, src: dict, dst: dict, chunks: int,
         compute_s: float) -> float:
    """One request in `mode`; seconds from the last compute (or the send) to the decode's Success."""
    decode.call("expect", rids=[rid], addr=prefill.bootstrap_address,
                indices=[{p: v.tolist() for p, v in dst.items()}])
    deadline = time.monotonic() + 30
    while not _expected(prefill, rid):  # the handshake and Expect stay outside the timing
        if time.monotonic() > deadline:
            raise SystemExit(f"{rid}: the prefill never saw the decode's Expect")
        time.sleep(0.0005)
    parts = np.array_split(src["kv"], chunks)
    if mode == "chunked":
        for k, pages in enumerate(parts):
            compute(compute_s)
            last = k == chunks - 1
            if last:
                t_last = time.monotonic()
            prefill.send(rid, {"kv": pages, **({"state": src["state"]} if last else {})}, last=last)
    else:
        if mode == "after":
            for _ in parts:
                compute(compute_s)
        t_last = time.monotonic()
        prefill.send(rid, src, last=True)
    got = decode.call("wait", rids=[rid], indices=[{p: v.tolist() for p, v in dst.items()}])
    if got["crc"][0] != entries_crc(prefill_pools(prefill), src):
        raise SystemExit(f"{rid} ({mode}): the decode's entries differ from the prefill's")
    prefill.wait(rid, 60.0)
    prefill.release(rid)
    decode.call("release", rids=[rid])
    return got["t"] - t_last


def _expected(prefill: PrefillEngine, rid: str) -> bool:
    try:
        return prefill.poll(rid) is KVPoll.WaitingForInput
    except UnknownRequestError:  # the decode's Expect has not reached the prefill yet
        return False


def prefill_pools(prefill: PrefillEngine) -> dict:
    return prefill.arenas


def run(backends: list[str], pages: int, chunks: int, compute_ms: float, reps: int, processes: int,
        out, report: br.Report, width: int = 0) -> list[dict]:
    """Every backend x mode; print one table and its legend; return one row per backend and mode."""
    kv_n, st_n = max(2 * pages, 64), 8
    rng = np.random.default_rng(0)
    columns = ["backend", "mode", "pages", "chunks", "compute ms", "exposed ms", "end-to-end ms", "hidden"]
    emit = br.markdown(columns, out, width, keys=2)
    progress = br.Progress(len(backends) * (reps + 1), "rounds")
    rows = []
    for backend in backends:
        pools = workload.pools("entry-major", kv_n, st_n)
        for arena in pools.values():  # random bytes: a crc of zeros would prove nothing
            arena.buf.copy_(torch.from_numpy(rng.integers(0, 256, arena.buf.numel(), dtype=np.uint8)))
        prefill = PrefillEngine(pools, EngineConfig(transport=backend, timeout=30.0))
        cross = processes == 2 and crosses_processes(backend)
        decode = ChildPeer(0, module="pdxfer.bench.decode_peer") if cross else LocalDecode()
        try:
            decode.call("open", backend=backend, kind="entry-major", kv_entries=kv_n, state_entries=st_n)
            exposed: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(reps + 1):
                src, dst = _request(rng, pages, kv_n, st_n)
                for mode in MODES:
                    s = _one(prefill, decode, f"{backend}-{mode}-{i}", mode, src, dst, chunks,
                             compute_ms / 1e3)
                    if i:  # round 0 warms connections and caches
                        exposed[mode].append(s)
                progress.step(f"{backend} round {i}")
        finally:
            decode.close()
            prefill.close()
        med = {m: statistics.median(v) * 1e3 for m, v in exposed.items()}
        for mode in MODES:
            busy = 0.0 if mode == "transfer only" else chunks * compute_ms
            row = {"backend": backend, "mode": mode, "pages": pages, "chunks": chunks if mode == "chunked" else 1,
                   "compute_ms": busy, "exposed_ms": med[mode], "end_to_end_ms": busy + med[mode],
                   "hidden": 1 - med["chunked"] / med["after"] if mode == "chunked" else None}
            rows.append(row)
            report.sample(backend=backend, mode=mode, seconds=exposed[mode])
            emit({"backend": backend, "mode": mode, "pages": str(pages), "chunks": str(row["chunks"]),
                  "compute ms": f"{busy:.0f}", "exposed ms": f"{med[mode]:.2f}",
                  "end-to-end ms": f"{row['end_to_end_ms']:.1f}",
                  "hidden": f"{row['hidden']:.0%}" if row["hidden"] is not None else ""})
    emit.close()
    meanings = {
        "backend": "transport of both engines" + (CHILD_NOTE if processes == 2 else ""),
        "mode": "chunked: send each chunk once computed (last=False); after: compute all, then one "
                "send; transfer only: no compute",
        "pages": "64 KiB KV pages in the request (plus one ~40 KiB state entry)",
        "chunks": "send() calls per request",
        "compute ms": "total busy time standing in for the forward pass (chunks x --compute-ms)",
        "exposed ms": "median ms from the end of the last compute (or the send) to the decode's Success",
        "end-to-end ms": "compute ms + exposed ms: first compute to decode Success",
        "hidden": "share of the transfer hidden behind compute: 1 - exposed(chunked) / exposed(after)",
    }
    report.finish(meanings, columns, rows, out)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench chunked`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench chunked", description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=bounded_int(2, 4096), default=256, help="KV pages per request")
    parser.add_argument("--chunks", type=bounded_int(2, 64), default=8, help="prefill chunks per request")
    parser.add_argument("--compute-ms", type=bounded_float(0.001, 60_000), default=10.0,
                        help="busy ms per chunk (0.001..60000)")
    parser.add_argument("--reps", type=bounded_int(1, 10_000), default=5, help="timed requests per mode (median)")
    parser.add_argument("--backends", default="loopback,tcp", help="comma-separated backends")
    parser.add_argument("--processes", type=bounded_int(1, 2), default=1,
                        help="2: the decode engine in a child process, as deployed")
    parser.add_argument("--tiny", action="store_true",
                        help="8 pages in 4 chunks of 1 ms, one timed request: a smoke run")
    br.add_output_args(parser, plot=False)
    args = parser.parse_args(argv)
    if args.tiny:
        args.pages, args.chunks, args.compute_ms, args.reps = 8, 4, 1.0, 1
    if args.chunks > args.pages:
        parser.error(f"--chunks {args.chunks} exceeds --pages {args.pages}: every chunk needs a page")
    backends = br.backends_arg(parser, args.backends)
    br.check_outputs(parser, args)
    report = br.Report("chunked", backends, {"pages": args.pages, "chunks": args.chunks,
                                             "compute_ms": args.compute_ms, "reps": args.reps,
                                             "processes": args.processes})
    print(f"# pdxfer bench chunked: {args.pages} pages in {args.chunks} chunks of {args.compute_ms} ms, "
          f"median of {args.reps}, {args.processes} process(es)")
    print(br.machine_line())
    run(backends, args.pages, args.chunks, args.compute_ms, args.reps, args.processes,
        lambda line: print(line, flush=True), report, br.terminal_width(args.width))
    report.write(args.json, report.data["columns"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
