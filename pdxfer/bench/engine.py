"""`pdxfer bench engine`: what the PD engine adds on top of the transport, per request.

For requests of 16 KV pages + 1 state entry, per backend and per KV layout
(entry-major vs layer-major), it measures:

- `send us`: CPU the caller's thread spends in `PrefillEngine.send()` once
  the decode's Expect is there, split into what it spends inside
  the pool's route (`Route.plan`: `layout` planning and the shift into the
  registered region, `plan`), inside the transport's `Connection.write`
  (`write`), and the rest — validation, destination cursors, notify
  payloads, bookkeeping (`engine`). The split is measured inside the same
  calls (that engine's routes and connection are wrapped with timers,
  `probes.probe_prefill`; nothing is changed for the rest of the process),
  so all three share the same cache and core contention;
- `bare write us`: the same tables posted on a bare transport connection,
  no engine, one `write` per pool;
- `req/s`: end-to-end throughput with the engine (send through decode
  Success and prefill Success) and with the bare transport (post through
  completion), `--batch` requests in flight;
- `cpu us/req`: CPU both processes spent (every thread: `process_time`)
  per request inside those same windows, engine and bare; on a machine
  whose cores are shared this is the steadier figure, and on a CPU-bound
  host their ratio bounds the requests/s ratio;
- `segments`: segments per request, checked equal to the contiguous runs the
  request names (entry-major: one per run of pages + one state entry;
  layer-major: one per field x layer x run).

CPU figures are the calling thread's `time.thread_time`, medians over all
requests: on a machine whose cores are shared, wall time per call mostly
measures who else held the GIL or the core. Throughput is wall clock. Pages
are drawn at random (scattered, as a paged allocator hands them out) with a
fixed seed, so runs repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from pdxfer import layout, transport

from ..cliargs import bounded_int, name_list
from ..config import EngineConfig, KVPoll
from ..errors import TransferTimeout
from ..prefill import PrefillEngine
from . import report as br
from . import workload
from .decode_peer import OPS as DECODE_OPS
from .decode_peer import DecodeSide, LocalDecode
from .peer import (
    ChildPeer,
    MismatchError,
    NetPeer,
    add_two_host_args,
    check_two_host_args,
    crosses_processes,
    listen,
    log,
)
from .probes import Split, probe_prefill
from .workload import ENTRIES, KINDS, KV_FIELDS, TINY_ENTRIES


def _runs(src: np.ndarray, dst: np.ndarray) -> int:
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    return 1 + int(np.count_nonzero(~((s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1))))


def _decode_side(backend: str, processes: int) -> Any:
    """The decode engine's driver: in a child process when asked and the backend can cross one."""
    if processes == 2 and crosses_processes(backend):
        return ChildPeer(0, module="pdxfer.bench.decode_peer")
    return LocalDecode()


def _await_expect(prefill: PrefillEngine, rid: str, timeout: float) -> None:
    """Until the prefill holds `rid`'s Expect; its failure, or `TransferTimeout` past `timeout`, raise.

    Polled, not waited on: the prefill has no record of the id until the
    Expect arrives (`try_poll` says None meanwhile), so `wait` would refuse it.
    """
    deadline = time.monotonic() + timeout
    while (state := prefill.try_poll(rid)) is not KVPoll.WaitingForInput:
        if state is KVPoll.Failed:
            raise prefill.failure(rid)
        if time.monotonic() > deadline:
            raise TransferTimeout(f"bench: the decode's Expect for {rid!r} did not reach the "
                                  f"prefill within {timeout} s (now {state})")
        time.sleep(0.0002)


def _here(decode: Any) -> str:
    """The address this side's engines listen on: where the other host reached us, else loopback."""
    return getattr(decode, "local", "127.0.0.1")


def _bench_engine(backend: str, kind: str, reqs: list, batch: int, decode: Any,
                  entries: tuple[int, int] = ENTRIES) -> dict[str, Any]:
    """The engine pass of one configuration; `decode` (a `_decode_side`) is reset after it."""
    cfg = EngineConfig(transport=backend, timeout=30.0, host=_here(decode))
    kv_n, st_n = entries
    prefill = PrefillEngine(workload.pools(kind, kv_n, st_n), cfg)
    rows, busy, cpu, segs, transfers = [], 0.0, 0.0, [], set()
    # CPU time of the calling thread inside the engine's own routes and connection
    plan, write = Split(time.thread_time), Split(time.thread_time)
    probed = False
    try:
        decode.call("open", backend=backend, kind=kind, kv_entries=kv_n, state_entries=st_n)
        for start in range(0, len(reqs), batch):
            chunk = list(enumerate(reqs[start:start + batch], start))
            rids = [f"r{i}" for i, _ in chunk]
            decode.call("expect", rids=rids, addr=prefill.bootstrap_address,
                        indices=[{p: v.tolist() for p, v in dst.items()} for _, (_, dst) in chunk])
            for i, _ in chunk:  # until the prefill has every Expect: time send() alone
                _await_expect(prefill, f"r{i}", cfg.timeout)
            if not probed:  # every Expect is there, so the data connection is open
                probe_prefill(prefill, plan, write)
                probed = True
            c0, d0 = time.process_time(), decode.call("cpu")
            t0 = time.perf_counter()
            for i, (src, _) in chunk:
                plan.total = write.total = 0.0
                t = time.thread_time()
                prefill.send(f"r{i}", src)
                rows.append((time.thread_time() - t, plan.total, write.total))
            decode.call("wait", rids=rids)
            for rid in rids:
                prefill.wait(rid, 60.0)
            busy += time.perf_counter() - t0
            cpu += time.process_time() - c0 + decode.call("cpu") - d0
            stats = decode.call("stats", rids=rids)
            segs += stats["segments"]
            transfers.update(stats["transfers"])
            decode.call("release", rids=rids)
            for rid in rids:
                prefill.release(rid)
    finally:
        decode.call("reset")
        prefill.close()

    def med(k: int) -> float:
        return statistics.median(r[k] for r in rows) * 1e6

    own = statistics.median(r[0] - r[1] - r[2] for r in rows) * 1e6
    return {"send_us": med(0), "plan_us": med(1), "write_us": med(2), "own_us": own,
            "rps": len(reqs) / busy, "cpu_us": cpu / len(reqs) * 1e6, "segments": segs,
            "transfers": transfers,
            "raw_us": [[round(v * 1e6, 3) for v in r] for r in rows]}


def _bench_transport(backend: str, kind: str, reqs: list, batch: int, b: Any,
                     entries: tuple[int, int] = ENTRIES) -> dict[str, float]:
    """The bare transport pass; its receiving engine lives in `b` (a `_decode_side`), reset after."""
    kv_n, st_n = entries
    src, dst = workload.pools(kind, kv_n, st_n), workload.pools(kind, kv_n, st_n)
    a = transport.create(backend, host=_here(b))
    try:
        local = {p: [a.register(buf) for buf in layout.arena_buffers(arena)] for p, arena in src.items()}
        far = b.call("bare", backend=backend, kind=kind, kv_entries=kv_n, state_entries=st_n)
        remote = far["descriptors"]
        conn = a.connect(far["address"])
        plans, posts, busy, cpu = [], [], 0.0, 0.0
        tables = []
        for s, d in reqs:
            t = time.thread_time()
            per = {p: layout.plan_segments(src[p], s[p], d[p], dst_entries=dst[p].entries) for p in s}
            plans.append(time.thread_time() - t)
            tables.append(per)
        for start in range(0, len(tables), batch):
            handles = []
            c0, d0 = time.process_time(), b.call("cpu")
            t0 = time.perf_counter()
            for per in tables[start:start + batch]:
                t = time.thread_time()
                for p, tables_ in per.items():  # one write per registered buffer
                    for region, desc, table in zip(local[p], remote[p], tables_, strict=True):
                        handles.append(conn.write(region, desc, table))
                posts.append(time.thread_time() - t)
            for h in handles:
                h.wait(60.0)
            busy += time.perf_counter() - t0
            cpu += time.process_time() - c0 + b.call("cpu") - d0
        segs = [sum(len(t) for ts in per.values() for t in ts) for per in tables]
        # verbs links count their work requests and doorbells (one per posted window)
        wrs = (f"{conn.wrs / len(reqs):.1f}/{conn.doorbells / len(reqs):.1f}"
               if hasattr(conn, "wrs") else "-")
    finally:
        a.close()
        b.call("reset")
    return {"plan_us": statistics.median(plans) * 1e6, "post_us": statistics.median(posts) * 1e6,
            "rps": len(reqs) / busy, "cpu_us": cpu / len(reqs) * 1e6, "segments": segs, "wrs": wrs,
            "transfers": {sum(len(ts) for ts in per.values()) for per in tables},
            "raw_post_us": [round(v * 1e6, 3) for v in posts]}


def _configuration(backend: str, kind: str, reqs: list, batch: int, decode: Any,
                   entries: tuple[int, int], report: br.Report) -> tuple[dict[str, Any], str]:
    """One backend x KV layout: engine and bare passes, segments checked; (row, WRs/doorbells)."""
    eng = _bench_engine(backend, kind, reqs, batch, decode, entries)
    raw = _bench_transport(backend, kind, reqs, batch, decode, entries)
    per_field = 1 if kind == "entry-major" else sum(f.layers for f in KV_FIELDS)
    want = [_runs(s["kv"], d["kv"]) * per_field + 1 for s, d in reqs]
    if eng["segments"] != want or raw["segments"] != want or eng["transfers"] != raw["transfers"]:
        raise SystemExit(f"{backend}/{kind}: segments or transfers per request differ from what "
                         "the request names")
    report.sample(backend=backend, kv_layout=kind,
                  send_plan_write_us=eng["raw_us"], bare_post_us=raw["raw_post_us"])
    row = {"backend": backend, "kv layout": kind, "segments": statistics.median(want),
           "transfers": max(eng["transfers"]),
           "send_us": eng["send_us"], "plan_us": eng["plan_us"], "write_us": eng["write_us"],
           "engine_us": eng["own_us"], "bare_write_us": raw["post_us"],
           "engine_rps": eng["rps"], "bare_rps": raw["rps"],
           "engine_cpu_us": eng["cpu_us"], "bare_cpu_us": raw["cpu_us"]}
    report.row(row)
    return row, raw["wrs"]


COLUMNS = {
    "backend": "transport backend of both engines",
    "kv layout": "entry-major (EntryMajorArena), layer-major (LayerMajorArena) or an engine's "
                 "per-layer tensors, each its own allocation (PerLayerArena) KV pool",
    "segments": "median segments per request (checked equal to the runs the request names)",
    "transfers": "writes posted per request (one per registered allocation a pool spans)",
    "send us": "median CPU us of the caller's thread in PrefillEngine.send()",
    "plan us": "... of which inside the pools' Route.plan (layout planning + region shift)",
    "write us": "... of which inside the transport's Connection.write",
    "engine us": "... the rest: validation, cursors, shifts, notify payloads, bookkeeping",
    "bare write us": "median CPU us posting the same tables on a bare transport connection",
    "engine req/s": "requests/s end to end through the engines, --batch in flight (wall clock)",
    "bare transport req/s": "requests/s posting and completing the tables on a bare connection",
    "engine cpu us/req": "CPU us of both processes (every thread) per request in the engine pass",
    "bare cpu us/req": "the same in the bare transport pass",
    "bare/engine cpu": "bare cpu us/req over engine cpu us/req: the req/s ratio a CPU-bound host allows",
    "WRs/doorbells": "verbs only: work requests / doorbells (posted windows) per request",
}


def _plot(rows: list[dict], path, note: str) -> None:
    """Requests/s, engine beside bare transport, per backend and KV layout (log when they span)."""
    def draw(plt) -> None:
        labels = [f"{r['backend']}\n{r['kv layout']}" for r in rows]
        x = np.arange(len(rows))
        plt.figure(figsize=(max(5, 1.3 * len(rows)), 3.6))
        engine, bare = [r["engine_rps"] for r in rows], [r["bare_rps"] for r in rows]
        plt.bar(x - 0.2, engine, 0.4, label="engine")
        plt.bar(x + 0.2, bare, 0.4, label="bare transport")
        plt.xticks(x, labels, fontsize=7)
        plt.ylabel("requests/s")
        br.log_if_dwarfed(plt.gca(), engine + bare)

    br.figure(path, draw, "pdxfer bench engine: requests/s", note)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one markdown table."""
    parser = argparse.ArgumentParser(prog="pdxfer bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=bounded_int(1, 10_000_000), default=2000,
                        help="requests per configuration (at least 1)")
    parser.add_argument("--batch", type=bounded_int(1, 4096), default=200,
                        help="requests in flight per batch (1..4096)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated transports (default: all available)")
    parser.add_argument("--processes", type=bounded_int(1, 2), default=1,
                        help="2: the decode side in a child process, as deployed (default 1)")
    parser.add_argument("--layouts", type=name_list, default=None,
                        help=f"comma-separated kv layouts (default: all of {', '.join(KINDS)})")
    parser.add_argument("--tiny", action="store_true",
                        help="6 requests, 3 in flight, loopback and tcp unless --backends says: a smoke run")
    add_two_host_args(parser)
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    kinds = KINDS if args.layouts is None else tuple(args.layouts)
    if set(kinds) - set(KINDS):
        parser.error(f"--layouts {','.join(kinds)}: choose from {', '.join(KINDS)}")
    entries = TINY_ENTRIES if args.tiny else ENTRIES
    if args.tiny:
        args.requests, args.batch = 6, 3
    backends = br.backends_arg(parser, args.backends, tiny=args.tiny)
    check_two_host_args(parser, args)
    br.check_outputs(parser, args)
    same = {"requests": args.requests, "batch": args.batch, "backends": backends,
            "layouts": list(kinds), "entries": list(entries)}
    if args.listen is not None:
        return listen(*args.listen, "engine", same, DecodeSide, DECODE_OPS, log)
    net = None
    if args.connect is not None:
        try:
            net = NetPeer(*args.connect, "engine", same)
        except MismatchError as exc:
            parser.error(f"--connect {args.connect[0]}:{args.connect[1]}: {exc}")
    report = br.Report("engine", backends, {"requests": args.requests, "batch": args.batch,
                                         "pages": workload.PAGES, "processes": args.processes,
                                         "connect": net.address if net is not None else None})
    reqs = workload.requests(args.requests, *entries, seed=0)
    where = (f"the decode side on {net.address}" if net is not None else
             f"{args.processes} process(es)")
    print(f"requests of {workload.describe()}; {args.requests} requests, "
          f"{args.batch} in flight; medians per request; {where}")
    print(br.machine_line())
    print()
    emit = br.markdown(list(COLUMNS), lambda line: print(line, flush=True),
                       br.terminal_width(args.width), keys=2)
    progress = br.Progress(len(backends) * len(kinds), "configurations")
    rows = []
    for backend in backends:
        # one child per backend (one --listen host for the run), reset in between
        decode = net if net is not None and crosses_processes(backend) else \
            _decode_side(backend, args.processes)
        try:
            for kind in kinds:
                row, wrs = _configuration(backend, kind, reqs, args.batch, decode, entries, report)
                rows.append(row)
                emit({"backend": backend, "kv layout": kind, "segments": f"{row['segments']:.0f}",
                      "transfers": str(row["transfers"]),
                      "send us": f"{row['send_us']:.1f}", "plan us": f"{row['plan_us']:.1f}",
                      "write us": f"{row['write_us']:.1f}", "engine us": f"{row['engine_us']:.1f}",
                      "bare write us": f"{row['bare_write_us']:.1f}",
                      "engine req/s": f"{row['engine_rps']:.0f}",
                      "bare transport req/s": f"{row['bare_rps']:.0f}",
                      "engine cpu us/req": f"{row['engine_cpu_us']:.0f}",
                      "bare cpu us/req": f"{row['bare_cpu_us']:.0f}",
                      "bare/engine cpu": f"{row['bare_cpu_us'] / row['engine_cpu_us']:.2f}",
                      "WRs/doorbells": wrs})
                progress.step(f"{backend} {kind}")
        finally:
            if decode is not net:
                decode.close()
    if net is not None:
        net.close()
    emit.close()
    br.print_legend(COLUMNS, list(COLUMNS))
    report.write(args.json, COLUMNS)
    if args.plot is not None:
        _plot(rows, args.plot, report.note(f"{args.requests} requests, {args.batch} in flight"))
    return 0
