"""`pdxfer bench peers`: one prefill against 1 … 128 decode peers — throughput, p99, memory, threads.

What grows with the number of peers rather than with work is what this
bench is for (#23). One `PrefillEngine` runs in this process; its decode
peers are real `DecodeEngine`s, held in fleets by child processes
(`fleet.py`; `--processes N`: this one plus N-1 children, so a prefill and
its decodes never share a GIL). Per backend, the decodes grow through
`--peers` (1, 16, 64, 128); at each count:

- **memory and threads**: once every decode has received a request (its
  data connection open), this process's resident memory and kernel thread
  count (`procstat`), and the prefill's `usage()` — bounce bytes (tcp:
  what is pinned once CUDA memory is registered), device scratch,
  NIXL registrations and prepared descriptors;
- **fan-in**: the mirror, at the transport: one receiving transport engine
  here with a 64 MiB region (a pool) registered, and as many sending
  engines in the children, each connected and having written once — what a
  decode heard from by that many prefills holds (nixl: an agent and a
  registration per inbound link when it can fence, one for all when not);
- **throughput and latency** (peer counts up to `--max-throughput-peers`,
  64): for each `--inflight` (1, 16, 256, 1024), requests round-robin over
  the peers with that many in flight: requests/s from the first `send()` to
  the last Success, and p50 / p99 of `send()` → the prefill seeing Success
  (the decode's Done), observed in send order by one waiter thread.

A request is `PAGES` scattered KV pages of 16 KiB (8 layers x 16 tokens x 1
head x 32 dims fp16, K and V), drawn at random from a 4096-page prefill
pool; each decode's pool holds as many pages as its share of the largest
in-flight count needs (requests reuse destinations only after they
finished). Decodes announce all of a point's requests first (`expect`),
then the prefill sends; after the point every decode request is waited for
and released. Loopback cannot cross processes and is not run.
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from pdxfer import layout

from ..cliargs import bounded_int, int_list
from ..config import EngineConfig
from . import procstat
from . import report as br
from .peer import ChildPeer, crosses_processes

PAGES = 4
KV_FIELDS = [
    layout.EntryField("k", 8, (16, 1, 32), torch.float16),
    layout.EntryField("v", 8, (16, 1, 32), torch.float16),
]
PREFILL_PAGES = 4096
PEERS = (1, 16, 64, 128)
INFLIGHT = (1, 16, 256, 1024)
MAX_THROUGHPUT_PEERS = 64
TIMEOUT = 120.0  # every engine's liveness and per-request wait: a loaded machine is slow, not dead

COLUMNS = ["backend", "peers", "in flight", "requests", "req/s", "p50 us", "p99 us"]
MEMORY_COLUMNS = ["backend", "side", "peers", "rss MiB", "rss KiB/peer", "threads", "threads/peer",
                  "bounce MiB", "scratch MiB", "registrations", "prepared descs"]
FAN_IN_REGION = 64 << 20


def pool(entries: int) -> layout.EntryMajorArena:
    """A kv pool of `entries` 16 KiB pages on the CPU, zeroed."""
    return layout.EntryMajorArena(KV_FIELDS, entries, "cpu")


class Fleets:
    """The decode peers: engines spread round-robin over `children` fleet processes."""

    def __init__(self, children: int) -> None:
        self.children: list[ChildPeer] = []
        try:
            for _ in range(children):
                self.children.append(ChildPeer(0, timeout=TIMEOUT * 4, module="pdxfer.bench.fleet"))
        except BaseException:
            self.close()
            raise
        self.where: list[tuple[int, int]] = []  # decode -> (child, engine index in it)
        self.capacity: list[int] = []  # decode -> pages in its pool

    def open(self, backend: str, count: int, pages: int, options: dict[str, Any]) -> None:
        """Add `count` decodes with `pages`-page pools, round-robin over the children."""
        k = len(self.children)
        per = [0] * k
        sizes = [sum(1 for w in self.where if w[0] == c) for c in range(k)]
        for _ in range(count):
            c = len(self.where) % k
            self.where.append((c, sizes[c]))
            sizes[c] += 1
            per[c] += 1
            self.capacity.append(pages)
        self._all("open", [dict(backend=backend, count=n, entries=pages, options=options,
                                timeout=TIMEOUT) for n in per])

    def expect(self, addr: str, requests: list[tuple[int, str, int]]) -> None:
        """Announce `(decode, rid, first page)` requests (PAGES pages each)."""
        batches: list[list[list[Any]]] = [[] for _ in self.children]
        for decode, rid, first in requests:
            c, e = self.where[decode]
            batches[c].append([e, rid, first, PAGES])
        self._all("expect", [dict(addr=addr, batch=b) for b in batches])

    def senders(self, backend: str, first: int, count: int, address: dict[str, Any],
                descriptor: dict[str, Any], options: dict[str, Any]) -> None:
        """Add senders `first .. first+count-1`, spread over the children; each writes once."""
        k = len(self.children)
        share = [count // k + (1 if c < count % k else 0) for c in range(k)]
        starts = [first + sum(share[:c]) for c in range(k)]
        self._all("senders", [dict(backend=backend, count=n, address=address, descriptor=descriptor,
                                   options=options, first=f) for n, f in zip(share, starts, strict=True)])

    def settle(self) -> None:
        """Wait for every announced request and release it, on every child."""
        self._all("settle", [dict(timeout=TIMEOUT)] * len(self.children))

    def reset(self) -> None:
        self._all("reset", [{}] * len(self.children))
        self.where.clear()
        self.capacity.clear()

    def _all(self, op: str, kws: list[dict[str, Any]]) -> list[Any]:
        waits = [child.start(op, **kw) for child, kw in zip(self.children, kws, strict=True)]
        return [w() for w in waits]

    def close(self) -> None:
        for child in self.children:
            child.close()


def _requests(n: int, peers: int, inflight: int, tag: str,
              rng: np.random.Generator) -> tuple[list[str], list[np.ndarray], list[tuple[int, str, int]]]:
    """Request ids, source pages, and `(decode, rid, first destination page)` of `n` requests."""
    slots = math.ceil(inflight / peers)
    rids = [f"{tag}-{i}" for i in range(n)]
    srcs = [rng.choice(PREFILL_PAGES, PAGES, replace=False) for _ in range(n)]
    dsts = [(i % peers, rids[i], ((i // peers) % slots) * PAGES) for i in range(n)]
    return rids, srcs, dsts


def _drive(prefill: Any, rids: list[str], srcs: list[np.ndarray], inflight: int) -> tuple[float, list[float]]:
    """Send every request with at most `inflight` unfinished: `(seconds, latency of each)`."""
    n = len(rids)
    sent, done = [0.0] * n, [0.0] * n
    room = threading.Semaphore(inflight)
    posted: queue.SimpleQueue[int] = queue.SimpleQueue()
    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            for _ in range(n):
                i = posted.get(timeout=TIMEOUT)
                rid = rids[i]
                prefill.wait(rid, TIMEOUT)
                done[i] = time.perf_counter()
                prefill.release(rid)
                room.release()
        except BaseException as exc:  # reported by the driver below
            failed.append(exc)
            for _ in range(n):
                room.release()

    thread = threading.Thread(target=waiter, name="bench-peers-waiter")
    thread.start()
    for i, rid in enumerate(rids):
        room.acquire()
        if failed:
            break
        sent[i] = time.perf_counter()
        prefill.send(rid, {"kv": srcs[i]})
        posted.put(i)
    thread.join(TIMEOUT * 2)
    if failed or thread.is_alive():
        raise SystemExit(f"bench peers: a request did not succeed: {failed[0] if failed else 'timeout'}")
    return done[-1] - sent[0], [d - s for d, s in zip(done, sent, strict=True)]


def _point(prefill: Any, fleets: Fleets, peers: int, inflight: int, n: int, tag: str,
           rng: np.random.Generator) -> tuple[float, list[float]]:
    rids, srcs, dsts = _requests(n, peers, inflight, tag, rng)
    fleets.expect(prefill.bootstrap_address, dsts)
    seconds, lat = _drive(prefill, rids, srcs, inflight)
    fleets.settle()
    return seconds, lat


def _memory_row(backend: str, side: str, peers: int, engine: Any, base_threads: int) -> dict[str, Any]:
    use, mine = engine.usage(), procstat.usage()
    return {"backend": backend, "side": side, "peers": peers, "rss": mine["rss"],
            "threads": mine["threads"],
            "base_threads": base_threads,
            "bounce": use.get("bounce_bytes", 0), "scratch": use.get("device_scratch_bytes", 0),
            "registrations": use.get("registrations", ""), "prepared": use.get("prepared_descriptors", ""),
            "links": use.get("links_out", 0)}


def _fmt_memory(row: dict[str, Any], before: dict[str, Any] | None) -> dict[str, str]:
    """One printed memory row; `before`: the same side's row at the next fewer peers, if any."""
    per = (row["threads"] - row["base_threads"]) / row["peers"]
    grown = ("" if before is None else
             f"{(row['rss'] - before['rss']) / 1024 / (row['peers'] - before['peers']):.0f}")
    return {"backend": row["backend"], "side": row["side"], "peers": str(row["peers"]),
            "rss MiB": f"{row['rss'] / 2**20:.0f}", "rss KiB/peer": grown, "threads": str(row["threads"]),
            "threads/peer": f"{per:.2f}", "bounce MiB": f"{row['bounce'] / 2**20:.1f}",
            "scratch MiB": f"{row['scratch'] / 2**20:.0f}", "registrations": str(row["registrations"]),
            "prepared descs": str(row["prepared"])}


def run_backend(backend: str, fleets: Fleets, peer_counts: list[int], inflights: list[int],
                requests: int | None, max_tp: int, report: br.Report, table: Any,
                memory: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    """Every peer count of one backend: memory row, then its throughput points."""
    from ..prefill import PrefillEngine

    options: dict[str, Any] = {"force_bounce": True} if backend == "tcp" else {}
    cfg = EngineConfig(transport=backend, timeout=TIMEOUT, transport_options=options)
    rng = np.random.default_rng(23)
    base_threads = procstat.usage()["threads"]
    prefill = PrefillEngine({"kv": pool(PREFILL_PAGES)}, cfg)
    try:
        opened = 0
        for peers in peer_counts:
            slots = math.ceil(max(inflights) / peers)
            fleets.open(backend, peers - opened, slots * PAGES, options)
            # warm: one request to every new decode opens its data connection
            _point(prefill, fleets, peers, peers, peers, f"{backend}-{peers}-warm", rng)
            opened = peers
            row = _memory_row(backend, "prefill: out", peers, prefill, base_threads)
            memory.append(row)
            report.sample(kind="memory", **row)
            if peers > max_tp:
                continue
            for inflight in inflights:
                n = requests or min(4096, max(256, 4 * inflight))
                seconds, lat = _point(prefill, fleets, peers, inflight, n, f"{backend}-{peers}-{inflight}", rng)
                us = sorted(x * 1e6 for x in lat)
                p50, p99 = statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))]
                res = {"backend": backend, "peers": peers, "inflight": inflight, "requests": n,
                       "req_s": n / seconds, "p50_us": p50, "p99_us": p99}
                results.append(res)
                report.sample(kind="throughput", latency_us=us, **res)
                table({"backend": backend, "peers": str(peers), "in flight": str(inflight),
                       "requests": str(n), "req/s": f"{n / seconds:.0f}", "p50 us": f"{p50:.0f}",
                       "p99 us": f"{p99:.0f}"})
    finally:
        prefill.close()
        fleets.reset()


def fan_in(backend: str, fleets: Fleets, peer_counts: list[int], report: br.Report,
           memory: list[dict[str, Any]]) -> None:
    """One receiving transport engine here, senders in the children: its usage at each count."""
    from pdxfer import transport

    options: dict[str, Any] = {"force_bounce": True} if backend == "tcp" else {}
    base_threads = procstat.usage()["threads"]
    rx = transport.create(backend, **options)
    got = threading.Semaphore(0)
    try:
        region = rx.register(torch.zeros(max(FAN_IN_REGION, 4096 * max(peer_counts)), dtype=torch.uint8))
        rx.set_notify_handler(lambda sender, payload: got.release())
        added = 0
        for peers in peer_counts:
            fleets.senders(backend, added, peers - added, rx.address(), region.descriptor(), options)
            for _ in range(peers - added):
                if not got.acquire(timeout=TIMEOUT):
                    raise SystemExit(f"bench peers: fan-in to {peers} {backend} senders: a notify is missing")
            added = peers
            row = _memory_row(backend, "transport: in", peers, rx, base_threads)
            memory.append(row)
            report.sample(kind="memory", **row)
    finally:
        rx.close()
        fleets.reset()


def legend(options: str) -> dict[str, str]:
    """What each printed column means."""
    return {
        "backend": f"transport of the prefill and every decode ({options})",
        "peers": "decode engines connected to the one prefill (in the child processes)",
        "in flight": "requests sent and not yet seen succeed (the prefill waits for room before a send)",
        "requests": f"requests timed at this point, {PAGES} scattered 16 KiB pages each",
        "req/s": "requests from the first send() to the last Success, per second (wall clock)",
        "p50 us": "median of send() -> the prefill seeing Success (decode's Done), observed in send order",
        "p99 us": "99th percentile of the same",
        "side": ("prefill: out = the PrefillEngine here linked to that many decodes; transport: in = "
                 "one receiving transport engine here (64 MiB registered) written to by that many "
                 "sending engines"),
        "rss MiB": "this process's resident memory once every peer has its connection (and wrote / was written)",
        "rss KiB/peer": ("resident memory grown per added peer since the row above (same side); the "
                         "prefill rows also carry what the throughput points before them left behind"),
        "threads": "this process's kernel threads then (UCX's, torch's and ours)",
        "threads/peer": "(threads - threads before the prefill existed) / peers",
        "bounce MiB": "tcp bounce pool bytes (pinned once CUDA memory is registered; forced here)",
        "scratch MiB": "the transport's device-copy scratch (0 on a CPU-only machine)",
        "registrations": "NIXL memory registrations held (our regions, every agent)",
        "prepared descs": "NIXL descriptors in prepared lists (bounded per engine)",
    }


def plot(results: list[dict[str, Any]], memory: list[dict[str, Any]], path: Any, note: str) -> None:
    """Requests/s, p99, RSS, threads and bounce bytes against peers: one series per backend and side.

    The throughput panel is the best over the in-flight counts (what one
    prefill can serve at that many peers), the latency panel the fewest in
    flight (what an idle decode sees); every in-flight count is in the table
    and `--json`. One value per backend and peer count keeps the legend to a
    line per backend and side (it had 20 entries).
    """
    backends = list(dict.fromkeys(r["backend"] for r in memory))
    inflights = sorted({r["inflight"] for r in results})
    peer_counts = sorted({r["peers"] for r in memory} | {r["peers"] for r in results})
    idlest = inflights[0] if inflights else 0

    def draw(plt: Any) -> None:
        _, axes = plt.subplots(1, 5, figsize=(19, 3.8))
        for b in backends:
            mine = [r for r in results if r["backend"] == b]
            xs = sorted({r["peers"] for r in mine})
            axes[0].plot(xs, [max(r["req_s"] for r in mine if r["peers"] == n) for n in xs],
                         label=f"{b}: prefill (out)")
            idle = sorted((r for r in mine if r["inflight"] == idlest), key=lambda r: r["peers"])
            axes[1].plot([r["peers"] for r in idle], [r["p99_us"] / 1e6 for r in idle],
                         label=f"{b}: prefill (out)")
            for side, label, ls in (("prefill: out", f"{b}: prefill (out)", "-"),
                                    ("transport: in", f"{b}: transport (in)", ":")):
                mem = sorted((r for r in memory if r["backend"] == b and r["side"] == side),
                             key=lambda r: r["peers"])
                xs = [r["peers"] for r in mem]
                look = {"ls": ls, "label": label}  # colour and marker per label: report.unify
                axes[2].plot(xs, [r["rss"] / 2**20 for r in mem], **look)
                axes[3].plot(xs, [r["threads"] for r in mem], **look)
                axes[4].plot(xs, [r["bounce"] / 2**20 for r in mem], **look)
        best = "/".join(map(str, inflights))
        titles = (f"requests/s, best of {best} in flight", f"p99 latency, {idlest} in flight",
                  "process RSS (MiB)", "process threads", "bounce pool, pinned with CUDA (MiB)")
        for ax, title in zip(axes, titles, strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xticks(peer_counts, [str(n) for n in peer_counts])  # 1, 16, 64, not 2^4
            ax.minorticks_off()
            ax.set_xlabel("decode peers (senders for 'transport: in')")
            ax.set_title(title, fontsize=9)
        br.time_axis(axes[1])
        br.log_if_dwarfed(axes[0], [line for ln in axes[0].get_lines() for line in ln.get_ydata()])
        br.log_if_dwarfed(axes[1], [r["p99_us"] for r in results if r["inflight"] == idlest])

    br.figure(path, draw, "pdxfer bench peers: one prefill, growing decode peers", note)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench peers`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench peers", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=None,
                        help="comma-separated (default: every installed one that crosses processes)")
    parser.add_argument("--peers", type=int_list(1, 4096), default=None, help=f"decode peer counts (default {PEERS})")
    parser.add_argument("--inflight", type=int_list(1, 4096), default=None, help=f"requests in flight (default {INFLIGHT})")
    parser.add_argument("--requests", type=bounded_int(1, 1_000_000), default=None,
                        help="requests per point (default 4 x in flight, 256..4096)")
    parser.add_argument("--max-throughput-peers", type=bounded_int(0, 4096), default=MAX_THROUGHPUT_PEERS,
                        help="peer counts above this get the memory row only")
    parser.add_argument("--processes", type=bounded_int(2, 64), default=None,
                        help="this process plus the children holding the decodes (default 3; --tiny 2)")
    parser.add_argument("--tiny", action="store_true",
                        help="tcp, 1 and 2 peers, 1 and 4 in flight, 16 requests, one child: a smoke run")
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    args.processes = args.processes or (2 if args.tiny else 3)
    br.check_outputs(parser, args)
    names = br.backends_arg(parser, args.backends, variants=True, tiny=args.tiny)
    backends = [b for b in names if crosses_processes(b)]
    if not backends:
        parser.error(f"none of {names} crosses processes; bench peers needs tcp, nixl or nixl-all")
    peer_counts = args.peers or list((1, 2) if args.tiny else PEERS)
    inflights = args.inflight or list((1, 4) if args.tiny else INFLIGHT)
    requests = args.requests or (16 if args.tiny else None)
    report = br.Report("peers", backends, {"peers": peer_counts, "inflight": inflights,
                                           "requests": requests, "processes": args.processes,
                                           "pages": PAGES})
    print(f"# pdxfer bench peers: one prefill, {peer_counts} decode peers in {args.processes - 1} "
          f"child process(es); {PAGES} x 16 KiB pages per request")
    print(br.machine_line())
    out = lambda line: print(line, flush=True)  # noqa: E731
    table = br.markdown(COLUMNS, out, br.terminal_width(args.width), keys=2)
    memory: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    fleets = Fleets(args.processes - 1)
    progress = br.Progress(len(backends), "backends")
    try:
        for backend in backends:
            run_backend(backend, fleets, peer_counts, inflights, requests, args.max_throughput_peers,
                        report, table, memory, results)
            fan_in(backend, fleets, peer_counts, report, memory)
            progress.step(backend)
    finally:
        fleets.close()
    table.close()
    out("")
    mtable = br.markdown(MEMORY_COLUMNS, out, br.terminal_width(args.width), keys=3)
    ordered = sorted(memory, key=lambda r: (backends.index(r["backend"]), r["side"], r["peers"]))
    for i, row in enumerate(ordered):
        before = ordered[i - 1] if i and (ordered[i - 1]["backend"], ordered[i - 1]["side"]) == (
            row["backend"], row["side"]) else None
        mtable(_fmt_memory(row, before))
    mtable.close()
    meanings = legend("tcp: force_bounce, so its bounce pool is what a GPU host pins")
    report.finish(meanings, COLUMNS + MEMORY_COLUMNS[2:], results, out)
    report.write(args.json, meanings)
    if args.plot is not None:
        plot(results, memory, args.plot, report.note(f"{args.processes} processes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
