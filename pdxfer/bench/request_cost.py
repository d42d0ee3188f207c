"""`pdxfer bench request-cost`: CPU one request costs the caller, split where it goes.

Issue #13 sets a budget of 20 us for the prefill's `send()` of 16 scattered
pages + 1 state entry and for the decode's `expect()`. Throughput runs
(`pdxfer bench engine`) mix that cost with the copy, notify and progress
threads competing for two cores, so this benchmark times the calls
themselves, many times, and splits them:

- `send`: `PrefillEngine.send()` once the decode's Expect is there, timed
  per call; split, in a second pass with timers wrapped around the pieces,
  into `plan` (the pools' `Route.plan`: `layout` planning and the region
  shift), `post` (the transport's `Connection.write`, table checks
  included) and `bookkeeping` (the rest: index checks, cursors, notify
  payloads, the request table, the lifecycle). The totals come from the
  first pass, which runs with no timers inside;
- `expect`: `DecodeEngine.expect()` timed per call, and beside it `check`:
  `expects.expect_message` (every index checked, the Expect's size bounded)
  called on its own with the same destinations right after each timed call
  — it is a pure function, so it is timed outside the engine rather than by
  wrapping the module function the engine calls;
- `bare`: the same pieces outside any engine, in a tight loop —
  `layout.plan_segments` for both pools, and `Connection.write` of the very
  tables the engine posted on a bare transport pair — the floor the engine
  adds to.

The observer's cost (#32: metrics and traces, `pdxfer/observe.py`): the
totals above run with metrics on (when prometheus_client is installed) and
traces on, the engine's default; `off` columns run a third pass with
`EngineConfig(metrics=False, traces=0)`, and `metrics`/`traces` time,
outside any engine, every observer call one request makes on both sides,
with one of the two on (begun, its
states, its events — a send, an expect, two writes, two notifies, the
control messages — and its finish into the counters and histograms).

A second table (`bench/rate.py`) sets the engine's requests/s and latency
beside the bare transport's on the same tables (issue #13 goal 2).

Every figure is a median over all calls, in microseconds, of wall time
(`perf_counter`) and, for the totals, also the calling thread's CPU time
(`thread_time`). On a shared machine the first measures who else held the
core; the second does not, so both are printed. While sends are timed, the
bytes of the requests before them may still be moving on other threads —
as in serving.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import numpy as np

from pdxfer import layout, transport

from ..cliargs import bounded_int
from ..config import EngineConfig
from ..decode import DecodeEngine
from ..expects import expect_message
from ..prefill import PrefillEngine
from . import rate, workload
from . import report as br
from .probes import Split, probe_prefill
from .rate import await_expects
from .workload import ENTRIES, TINY_ENTRIES


def _med(values: list[float]) -> float:
    return statistics.median(values) / 1000.0 if values else float("nan")


def _engine_pass(backend: str, reqs: list, batch: int, split: bool,
                 entries: tuple[int, int] = ENTRIES, observe: bool = True) -> dict[str, list]:
    """One run of all requests through a fresh engine pair: per-call times (ns).

    `observe` False: no metrics, no traces (the `off` columns).
    """
    cfg = (EngineConfig(transport=backend, timeout=30.0) if observe
           else EngineConfig(transport=backend, timeout=30.0, metrics=False, traces=0))
    prefill = PrefillEngine(workload.pools("entry-major", *entries), cfg)
    decode = DecodeEngine(workload.pools("entry-major", *entries), cfg)
    out: dict[str, list] = {k: [] for k in ("send", "send_cpu", "plan", "post", "expect",
                                            "expect_cpu", "check", "tables")}
    plan, post = Split(), Split()
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    try:
        # A first request opens the link and warms every path before timing.
        decode.expect("warm", prefill.bootstrap_address, reqs[0][1])
        await_expects(prefill, ["warm"])
        prefill.send("warm", reqs[0][0])
        decode.wait("warm", 60.0)
        prefill.wait("warm", 60.0)
        if split:
            probe_prefill(prefill, plan, post)
        for start in range(0, len(reqs), batch):
            chunk = list(enumerate(reqs[start:start + batch], start))
            for i, (_, dst) in chunk:
                c, t = cpu(), clock()
                decode.expect(f"r{i}", prefill.bootstrap_address, dst)
                out["expect"].append(clock() - t)
                out["expect_cpu"].append(cpu() - c)
                if split:  # what expect() checks and frames, timed on its own: it is pure
                    t = clock()
                    expect_message(decode.pool_set, f"r{i}", i, dst)
                    out["check"].append(clock() - t)
            await_expects(prefill, [f"r{i}" for i, _ in chunk])
            for i, (src, _) in chunk:
                plan.total = post.total = 0
                c, t = cpu(), clock()
                prefill.send(f"r{i}", src)
                out["send"].append(clock() - t)
                out["send_cpu"].append(cpu() - c)
                out["plan"].append(plan.total)
                out["post"].append(post.total)
            for i, _ in chunk:
                decode.wait(f"r{i}", 60.0)
                prefill.wait(f"r{i}", 60.0)
                decode.release(f"r{i}")
                prefill.release(f"r{i}")
    finally:
        decode.close()
        prefill.close()
    return out


def _bare(backend: str, reqs: list, reps: int, entries: tuple[int, int] = ENTRIES) -> dict[str, float]:
    """`plan_segments` and `Connection.write` of the same tables, no engine: medians (us)."""
    src, dst = workload.pools("entry-major", *entries), workload.pools("entry-major", *entries)
    a, b = transport.create(backend), transport.create(backend)
    clock = time.perf_counter_ns
    plans, posts = [], []
    try:
        local = {p: a.register(layout.arena_buffers(arena)[0]) for p, arena in src.items()}
        remote = {p: b.register(layout.arena_buffers(arena)[0]).descriptor() for p, arena in dst.items()}
        conn = a.connect(b.address())
        for r in range(reps):
            s, d = reqs[r % len(reqs)]
            t = clock()
            tables = {p: layout.plan_segments(src[p], s[p], d[p], dst_entries=dst[p].entries)[0]
                      for p in s}
            plans.append(clock() - t)
            t = clock()
            handles = [conn.write(local[p], remote[p], tables[p], b"n") for p in tables]
            posts.append(clock() - t)
            for h in handles:
                h.wait(60.0)
    finally:
        a.close()
        b.close()
    return {"plan": _med(plans), "post": _med(posts)}


def _hooks(sides: list, batch: int, start: int) -> float:
    """CPU ns per request of every observer call one request makes on both `sides`.

    The calling thread's CPU time (`thread_time`) over the batch: wall time on
    a shared machine measures the other tenants.
    """
    from ..config import KVPoll
    from ..requests import Request

    class Life:  # the one field the observer reads of a lifecycle
        seen = KVPoll.Transferring

    posted = ("chunk={} part={}/{} bytes={} segments={}", 0, 0, 2, 4096, 16)
    reqs = [[Request(f"h{start + i}", Life()) for _ in sides] for i in range(batch)]
    t = time.thread_time_ns()
    for pair in reqs:
        for obs, req in zip(sides, pair, strict=True):
            obs.on_added(req)
            obs.event(req, "expect", ("decode={} xid={}", "peer", 1))
            obs.event(req, "send", ("last={}", True))
            obs.on_state(req, KVPoll.WaitingForInput)
            obs.event(req, "posted", posted)
            obs.event(req, "posted", posted)
            obs.on_state(req, KVPoll.Transferring)
            obs.event(req, "received", "done")
            req.state, req.ended, req.nbytes, req.segments, req.transfers = (
                KVPoll.Success, req.started + 0.001, 8192, 32, 2)
            req.wire_from = req.started
            obs.on_finished(req)
    return (time.thread_time_ns() - t) / batch


def _observer_cost(reps: int) -> dict[str, float]:
    """CPU us the metrics and the traces each add per request, both sides.

    Batches of all off, metrics only and traces only take turns, and each
    figure is the median over rounds of (its batch - the off batch beside it),
    so a load swing between rounds cancels.
    """
    from ..observe import Observer, metrics_available

    def pair(metrics: bool, traces: bool) -> list:
        return [Observer(role, "bench", metrics=metrics and metrics_available(),
                         traces=1024 if traces else 0, levels=dict)
                for role in ("prefill", "decode")]

    kinds = {"off": pair(False, False), "metrics_us": pair(True, False),
             "traces_us": pair(False, True)}
    batch, diffs = 250, {"metrics_us": [], "traces_us": []}
    for r in range(max(1, reps // batch)):
        ns = {k: _hooks(sides, batch, r * batch) for k, sides in kinds.items()}
        for k in diffs:
            diffs[k].append(ns[k] - ns["off"])
    return {k: _med(v) for k, v in diffs.items()}


COLUMNS = {
    "backend": "transport backend of both engines",
    "send us": "median wall us of PrefillEngine.send() (16 scattered pages + 1 state entry)",
    "send cpu us": "... the calling thread's CPU time (thread_time)",
    "plan us": "... inside Route.plan: layout planning + region shift (second, timed pass)",
    "post us": "... inside Connection.write, table checks included (second pass)",
    "bookkeeping us": "... the rest of send() in the second pass",
    "expect us": "median wall us of DecodeEngine.expect() of the same destinations",
    "expect cpu us": "... the calling thread's CPU time",
    "expect check us": "expects.expect_message (index checks, size bound) on the same "
                       "destinations, timed on its own (second pass)",
    "send off us": "send us with EngineConfig(metrics=False, traces=0): no observer (third pass)",
    "expect off us": "expect us, likewise",
    "metrics us": "CPU the metrics add per request, both sides: the observer's calls of one "
                  "request timed alone, metrics on less all off (0 without prometheus_client)",
    "traces us": "... traces on less all off",
    "bare plan us": "plan_segments for both pools in a tight loop, no engine",
    "bare post us": "Connection.write of both tables on a bare transport pair, no engine",
}


RATE_COLUMNS = {
    "backend": "transport backend",
    "engine req/s": "requests/s through both engines, --batch in flight (median of rounds)",
    "bare req/s": "requests/s posting the same planned tables on a bare connection",
    "engine/bare": "engine req/s over bare req/s, each round's pair taken together (median)",
    "engine p50 us": "latency send() -> decode Success, one request at a time",
    "engine p99 us": "... its 99th percentile",
    "bare p50 us": "latency posting the same tables with a notify each -> the receiver's last notify",
    "bare p99 us": "... its 99th percentile",
}


def _rates(backend: str, reqs: list, args: argparse.Namespace,
           entries: tuple[int, int] = ENTRIES) -> dict[str, Any]:
    """Goal 2's row: engine and bare requests/s and latency, rounds alternating."""
    pools = functools.partial(workload.pools, "entry-major", *entries)
    kv_n, st_n = entries
    rng = np.random.default_rng(1)
    small = [({"kv": rng.choice(kv_n, args.latency_pages, replace=False), "state": np.array([i % st_n])},
              {"kv": rng.choice(kv_n, args.latency_pages, replace=False), "state": np.array([i % st_n])})
             for i in range(args.latency)]
    eng_rps, bare_rps, ratios, eng_lat, bare_lat = [], [], [], [], []
    for _ in range(args.rounds):
        e = rate.engine_run(pools, backend, reqs, args.batch, small)
        b = rate.bare_run(pools, backend, reqs, args.batch, small)
        eng_rps.append(e["rps"])
        bare_rps.append(b["rps"])
        ratios.append(e["rps"] / b["rps"])
        eng_lat += e["latency_ns"]
        bare_lat += b["latency_ns"]
    return {"backend": backend, "engine req/s": statistics.median(eng_rps),
            "bare req/s": statistics.median(bare_rps), "engine/bare": statistics.median(ratios),
            "engine p50 us": rate.percentile(eng_lat, 0.5), "engine p99 us": rate.percentile(eng_lat, 0.99),
            "bare p50 us": rate.percentile(bare_lat, 0.5), "bare p99 us": rate.percentile(bare_lat, 0.99)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one markdown table."""
    parser = argparse.ArgumentParser(prog="pdxfer bench request-cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=bounded_int(1, 10_000_000), default=2000,
                        help="requests per pass (at least 1)")
    parser.add_argument("--batch", type=bounded_int(1, 4096), default=100,
                        help="expects (then sends) issued back to back per batch (1..4096)")
    parser.add_argument("--rounds", type=bounded_int(1, 100), default=2,
                        help="alternating rounds of each measurement (1..100)")
    parser.add_argument("--latency", type=bounded_int(1, 10_000_000), default=300,
                        help="requests timed one at a time for latency (at least 1)")
    parser.add_argument("--latency-pages", type=bounded_int(1, 64), default=1,
                        help="KV pages per latency request (1..64)")
    parser.add_argument("--backends", default="loopback,tcp",
                        help="comma-separated transports (default: loopback,tcp)")
    parser.add_argument("--tiny", action="store_true",
                        help="12 requests, 4 per batch, one round, 3 latency requests: a smoke run")
    br.add_output_args(parser, plot=False)
    args = parser.parse_args(argv)
    entries = TINY_ENTRIES if args.tiny else ENTRIES
    if args.tiny:
        args.requests, args.batch, args.rounds, args.latency = 12, 4, 1, 3
    backends = br.backends_arg(parser, args.backends)
    br.check_outputs(parser, args)
    report = br.Report("request-cost", backends, {"requests": args.requests, "batch": args.batch,
                                                  "pages": workload.PAGES})
    reqs = workload.requests(args.requests, *entries, seed=0)
    print(f"send() of {workload.describe()}, scattered, entry-major; {args.requests} requests, "
          "medians per call")
    print(br.machine_line())
    print()
    width = br.terminal_width(args.width)
    emit = br.markdown(list(COLUMNS), lambda line: print(line, flush=True), width)
    progress = br.Progress(len(backends), "backends")
    rows = []
    for backend in backends:
        whole: dict[str, list] = {}
        parts: dict[str, list] = {}
        off: dict[str, list] = {}
        for _ in range(args.rounds):  # alternating, so load bursts hit every pass
            for acc, split, observe in ((whole, False, True), (parts, True, True),
                                        (off, False, False)):
                for k, v in _engine_pass(backend, reqs, args.batch, split, entries,
                                         observe).items():
                    acc.setdefault(k, []).extend(v)
        bare = _bare(backend, reqs, args.requests, entries)
        own = [s - p - q for s, p, q in zip(parts["send"], parts["plan"], parts["post"], strict=True)]
        row = {"backend": backend,
               "send_us": _med(whole["send"]), "send_cpu_us": _med(whole["send_cpu"]),
               "plan_us": _med(parts["plan"]), "post_us": _med(parts["post"]),
               "bookkeeping_us": _med(own),
               "expect_us": _med(whole["expect"]), "expect_cpu_us": _med(whole["expect_cpu"]),
               "expect_check_us": _med(parts["check"]),
               "send_off_us": _med(off["send"]), "expect_off_us": _med(off["expect"]),
               # 10 per request timed above, 500..20,000: a few seconds at full size
               **_observer_cost(min(20_000, max(500, 10 * args.requests))),
               "bare_plan_us": bare["plan"], "bare_post_us": bare["post"]}
        report.row(row)
        report.sample(backend=backend, send_ns=whole["send"], expect_ns=whole["expect"])
        emit({k: row[k.replace(" ", "_")] if k == "backend" else f"{row[k.replace(' ', '_')]:.1f}"
              for k in COLUMNS})
        rows.append(_rates(backend, reqs, args, entries))
        progress.step(backend)
    emit.close()
    print()
    print(f"requests/s with {args.batch} in flight, and latency of {args.latency} requests of "
          f"{args.latency_pages} page(s) + 1 state entry sent one at a time (send() to decode "
          f"Success; bare: post to the receiver's last notify); {args.rounds} alternating rounds")
    print()
    emit = br.markdown(list(RATE_COLUMNS), lambda line: print(line, flush=True), width)
    for row in rows:
        report.row(row)
        emit({k: row[k] if isinstance(row[k], str) else f"{row[k]:.{2 if 'engine/' in k else 0}f}"
              for k in RATE_COLUMNS})
    emit.close()
    br.print_legend(COLUMNS, list(COLUMNS))
    br.print_legend(RATE_COLUMNS, list(RATE_COLUMNS))
    report.write(args.json, {**COLUMNS, **RATE_COLUMNS})
    return 0
