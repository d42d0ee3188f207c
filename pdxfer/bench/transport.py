"""`pdxfer bench transport`: transport throughput beside the baselines it must beat.

Moves the same bytes (256 MiB by default) as 64 x 4 MiB, 4096 x 64 KiB and
65,536 x 4 KiB segments, each in source order ("contiguous": row i goes to
slot i — deliberately *not* merged into one row, so the per-segment cost
shows) and with destination slots shuffled. Per case, in the same run:

- `memcpy`: one `numpy.copyto` of the whole buffer — the ceiling for loopback;
- `memcpy/seg`: one `numpy` slice copy per segment, single thread — what the
  segment structure alone costs (glibc switches to non-temporal stores only
  for very large copies, so the one-call figure can be out of reach of any
  per-segment copy on some machines);
- `loopback`: one `write` of the whole table between two loopback engines;
- `raw socket`: one TCP connection over 127.0.0.1 moving each segment with
  one `sendall` and one `recv_into` loop — what a naive socket transport does;
- `tcp`: one `write` between two tcp engines (default stream count), and
  `tcp 1 stream` to show what striping adds;
- any other installed backend (`nixl`, `ucx`, their `-all` variants): one
  `write` between two engines, beside memcpy and tcp — and `nixl` and `ucx`
  beside raw NIXL over tcp, the same UCX transport under both;
- with nixl installed, `raw NIXL (tcp)` and `raw NIXL (UCX default)`: NIXL
  agents used directly (`bench/rawnixl.py`: prepared descriptor lists, one
  reposted request), on our nixl backend's UCX transports and on UCX's own
  choice — the baselines `nixl` and `tcp` are held to.

`--processes 2` puts every receiving endpoint that can live in another
process (`peer.ChildPeer`) in a child process, as deployed: sender and
receiver then share no GIL. memcpy and loopback stay in this process.

Every figure is the median of `--reps` timed runs after one warm-up; the
destination is zeroed before each run and its crc32 compared with the
expected buffer's after it, so a run that moved the wrong bytes aborts the
benchmark instead of printing a fast number. This is a benchmark, not a test:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch

from pdxfer import transport

from ..cliargs import bounded_int
from . import report as br
from .peer import (
    CHILD_NOTE,
    OPS,
    ChildPeer,
    LocalPeer,
    MismatchError,
    NetPeer,
    Receiver,
    add_two_host_args,
    check_two_host_args,
    listen,
    log,
)
from .rawnixl import RawNixlPair

Peer = LocalPeer | ChildPeer | NetPeer
Run = tuple[Callable[[], None], int, Peer]
RAW_TCP, RAW_DEFAULT = "raw NIXL (tcp)", "raw NIXL (UCX default)"

MiB = 1 << 20
SEGMENTS = (4 * MiB, 64 * 1024, 4 * 1024)


def _table(total: int, seg: int, shuffled: bool, rng: np.random.Generator) -> np.ndarray:
    n = total // seg
    slots = rng.permutation(n) if shuffled else np.arange(n)
    return np.stack([np.arange(n) * seg, slots * seg, np.full(n, seg)], 1).astype(np.int64)


def _copy_each(src: np.ndarray, dst: np.ndarray, table: np.ndarray) -> None:
    for s, d, n in table.tolist():
        dst[d:d + n] = src[s:s + n]


def _expected_crc(src: np.ndarray, table: np.ndarray) -> int:
    out = np.zeros_like(src)
    _copy_each(src, out, table)
    return zlib.crc32(out)


def _measure(runs: dict[str, Run], reps: int,
             tick: Callable[[int], None] = lambda i: None) -> dict[str, list[float]]:
    """Seconds of each timed run by method, every run verified by crc32 of its destination.

    The methods take turns within each repetition rather than running their
    reps back to back, so a burst of load from other processes on a shared
    machine hits all of them alike and the ratios stay fair. `tick(i)` is
    called after round `i` (0: the warm-up), so progress shows within a case.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(reps + 1):
        for name, (run, crc, peer) in runs.items():
            peer.call("zero")
            t0 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t0
            got = peer.call("crc")
            if got != crc:
                raise SystemExit(f"{name}: run {i} moved wrong bytes (crc32 {got:#x}, expected {crc:#x})")
            if i:  # round 0 warms caches, page tables and connections
                times[name].append(elapsed)
        tick(i)
    return times


# What the up-front estimate assumes per segment of a per-segment method
# (memcpy/seg, raw socket: a Python loop iteration each) and per byte of a
# run beyond one pass over the buffer (zero, copy, crc32). Rough on purpose:
# the progress line's ETA, from measured rounds, replaces it within seconds.
_EST_SEGMENT_S = 2e-6
_EST_PASSES = 4


def estimate(total: int, reps: int, methods: int, per_segment_methods: int) -> float:
    """Seconds a run should take, scaled by one timed pass over a `total`-byte buffer here.

    Every method of every case runs `reps + 1` times; each run costs a few
    passes over the buffer (zero it, move it, crc32 it), and the per-segment
    methods a Python iteration per segment on top.
    """
    buf = np.ones(total, dtype=np.uint8)
    out = np.empty_like(buf)
    t0 = time.perf_counter()
    np.copyto(out, buf)
    zlib.crc32(out)
    one_pass = (time.perf_counter() - t0) / 2
    rounds = (reps + 1) * 2  # contiguous and shuffled
    seconds = 0.0
    for seg in SEGMENTS:
        seconds += rounds * (methods * _EST_PASSES * one_pass
                             + per_segment_methods * (total // seg) * _EST_SEGMENT_S)
        seconds += 2 * (total // seg) * _EST_SEGMENT_S  # each case's expected crc32, a loop too
    return seconds


class _RawPair:
    """A plain TCP connection over 127.0.0.1: one sendall / recv_into loop per segment."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        host, port = peer.call("raw_listen")
        self.where = host  # where the receiving side listened (the --json says)
        self.tx = socket.create_connection((host, port))
        self.tx.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer.call("raw_accept")
        self.rows: list[list[int]] = []

    def prepare(self, table: np.ndarray) -> None:
        self.rows = table.tolist()
        self.peer.call("raw_table", table=np.ascontiguousarray(table, dtype="<i8").tobytes())

    def move(self, src: np.ndarray) -> None:
        sview = memoryview(src)
        landed = self.peer.start("raw_recv")
        for s, _, n in self.rows:
            self.tx.sendall(sview[s:s + n])
        landed()

    def close(self) -> None:
        self.tx.close()


class _EnginePair:
    """An engine here and one of the same backend at `remote`, the buffers registered once.

    A backend that cannot cross processes (loopback, the verbs fabric) gets
    its receiver in this process, `local`, whatever `--processes` says.
    """

    def __init__(self, backend: str, src: np.ndarray, local: LocalPeer, remote: Peer,
                 **options: object) -> None:
        self.tx = transport.create(backend, host=getattr(remote, "local", "127.0.0.1"), **options)
        self.peer = peer = remote if self.tx.capabilities.cross_process else local
        self.local = self.tx.register(torch.from_numpy(src))
        far = peer.call("engine", backend=backend, options=options)
        self.remote = far["descriptor"]
        address = far["address"]
        self.where = address.get("host", "") if isinstance(address, dict) else ""
        self.conn = self.tx.connect(address)

    def move(self, table: np.ndarray) -> None:
        self.conn.write(self.local, self.remote, table).wait(120)

    def wrs(self, table: np.ndarray) -> str:
        """`WRs/doorbells` one write of `table` posts, for links that count them (verbs)."""
        if not hasattr(self.conn, "wrs"):
            return ""
        w, d = self.conn.wrs, self.conn.doorbells
        self.move(table)
        return f"{self.conn.wrs - w}/{self.conn.doorbells - d}"

    def close(self) -> None:
        self.tx.close()


def _runs(src: np.ndarray, local: LocalPeer, table: np.ndarray, pairs: dict[str, _EnginePair],
          raw: _RawPair | None, nixls: dict[str, RawNixlPair]) -> dict[str, Run]:
    """Every method of one case, each with the crc32 its destination must end with."""
    crc = _expected_crc(src, table)
    dst = local.dst
    runs: dict[str, Run] = {
        "memcpy": (lambda: np.copyto(dst, src), zlib.crc32(src), local),
        "memcpy/seg": (lambda: _copy_each(src, dst, table), crc, local),
    }
    for label, pair in pairs.items():
        runs[label] = (lambda p=pair: p.move(table), crc, pair.peer)
    if raw is not None:
        raw.prepare(table)
        runs["raw socket"] = (lambda: raw.move(src), crc, raw.peer)
    for label, rn in nixls.items():
        rn.prepare(table)
        runs[label] = (rn.move, crc, rn.peer)
    return runs


def legend(columns: list[str], streams: int, processes: int = 1,
           other_host: str = "") -> dict[str, str]:
    """What each printed column means (GB/s unless a ratio)."""
    where = ("both sides in this process" if processes == 1 else CHILD_NOTE.lstrip("; "))
    if other_host:
        where = (f"receiving side on the --listen host {other_host} (memcpy, memcpy/seg and "
                 "loopback stay on this host: the local ceilings)")
    fixed = {
        "case": (f"segments x segment size; contiguous: row i -> slot i, shuffled: destination slots "
                 f"permuted; {where}"),
        "memcpy": "one numpy.copyto of the whole buffer, GB/s (loopback's ceiling)",
        "memcpy/seg": "one numpy slice copy per segment, single thread, GB/s",
        "loopback": "one write of the whole table between two loopback engines, GB/s",
        "loopback/memcpy": "loopback GB/s over memcpy GB/s",
        "loopback/(memcpy/seg)": "loopback GB/s over memcpy/seg GB/s",
        "raw socket": "one TCP connection (over 127.0.0.1, or to the --listen host), one sendall + recv_into loop per segment, GB/s",
        f"tcp ({streams} streams)": "one write between two tcp engines (default stream count), GB/s",
        "tcp/raw": "tcp GB/s over raw socket GB/s",
        "tcp 1 stream": "one write between two tcp engines with streams=1, GB/s",
        RAW_TCP: ("NIXL agents used directly, UCX limited to tcp (as our nixl backend): descriptor "
                  "lists and one request prepared per table, reposted per run, GB/s"),
        RAW_DEFAULT: "the same with UCX's default transports (cma / shared memory on one host), GB/s",
        "tcp/raw NIXL (UCX default)": "tcp GB/s over raw NIXL (UCX default) GB/s",
        "nixl/raw NIXL (tcp)": "nixl GB/s over raw NIXL (tcp) GB/s",
        "nixl-all/raw NIXL (UCX default)": "nixl-all GB/s over raw NIXL (UCX default) GB/s",
        "ucx/raw NIXL (tcp)": "ucx GB/s over raw NIXL (tcp) GB/s (both UCX over tcp)",
    }
    out = {}
    for c in columns:
        if c in fixed:
            out[c] = fixed[c]
        elif c.endswith(" WRs/doorbells"):
            out[c] = (f"work requests / doorbells (posted windows) one write of the table costs "
                      f"on a {c.split(' ')[0]} link")
        elif c.endswith("/memcpy"):
            out[c] = f"{c.split('/')[0]} GB/s over memcpy GB/s"
        elif c.endswith("/tcp"):
            out[c] = f"{c.split('/')[0]} GB/s over tcp GB/s"
        else:
            out[c] = f"one write of the whole table between two {c} engines, GB/s"
    return out


def _pairs(backends: list[str], src: np.ndarray, local: LocalPeer, remote: Peer, columns: list[str],
           pairs: dict[str, _EnginePair], nixls: dict[str, RawNixlPair]) -> _RawPair | None:
    """Open every method's endpoints into `pairs`/`nixls` (so a failure halfway still closes
    what opened), appending their columns; returns the raw socket pair, if tcp runs."""
    raw = None
    if "loopback" in backends:
        pairs["loopback"] = _EnginePair("loopback", src, local, local)
        columns += ["loopback", "loopback/memcpy", "loopback/(memcpy/seg)"]
    if "tcp" in backends:
        raw = _RawPair(remote)
        pairs["tcp"] = _EnginePair("tcp", src, local, remote)
        pairs["tcp 1 stream"] = _EnginePair("tcp", src, local, remote, streams=1)
        columns += ["raw socket", _tcp_col(pairs), "tcp/raw", "tcp 1 stream"]
    if "nixl" in backends or "nixl-all" in backends:
        # NIXL itself, on the transports our nixl backend uses and on UCX's own choice.
        nixls[RAW_TCP] = RawNixlPair(src, remote, "tcp")
        nixls[RAW_DEFAULT] = RawNixlPair(src, remote, "")
        columns += [RAW_TCP, RAW_DEFAULT] + (["tcp/raw NIXL (UCX default)"] if raw is not None else [])
    # Any other backend gets its figure beside the memcpy and, when tcp
    # runs too, its ratio to tcp: the socket path every host has.
    for name in [b for b in backends if b not in ("loopback", "tcp")]:
        pairs[name] = _EnginePair(name, src, local, remote)
        columns += [name, f"{name}/memcpy"] + ([f"{name}/tcp"] if raw is not None else [])
        if name in ("nixl", "ucx") and nixls:
            columns.append(f"{name}/raw NIXL (tcp)")
        if name == "nixl-all":
            columns.append("nixl-all/raw NIXL (UCX default)")
        if hasattr(pairs[name].conn, "wrs"):
            columns.append(f"{name} WRs/doorbells")
    return raw


def _tcp_col(pairs: dict[str, _EnginePair]) -> str:
    return f"tcp ({pairs['tcp'].tx.streams} streams)"


def _row(name: str, gbs: dict[str, float], pairs: dict[str, _EnginePair], table: np.ndarray) -> dict[str, str]:
    """One printed row: GB/s per method and the ratios the columns name."""
    row = {"case": name, **{k: f"{v:.2f}" for k, v in gbs.items()}}

    def ratio(col: str, a: str, b: str) -> None:
        if a in gbs and b in gbs:
            row[col] = f"{gbs[a] / gbs[b]:.2f}x"

    ratio("loopback/memcpy", "loopback", "memcpy")
    ratio("loopback/(memcpy/seg)", "loopback", "memcpy/seg")
    ratio("tcp/raw", "tcp", "raw socket")
    ratio("tcp/raw NIXL (UCX default)", "tcp", RAW_DEFAULT)
    ratio("nixl/raw NIXL (tcp)", "nixl", RAW_TCP)
    ratio("nixl-all/raw NIXL (UCX default)", "nixl-all", RAW_DEFAULT)
    ratio("ucx/raw NIXL (tcp)", "ucx", RAW_TCP)
    for other in [p for p in pairs if p not in ("loopback", "tcp", "tcp 1 stream")]:
        ratio(f"{other}/memcpy", other, "memcpy")
        ratio(f"{other}/tcp", other, "tcp")
        row[f"{other} WRs/doorbells"] = pairs[other].wrs(table)
    if "tcp" in pairs:
        row[_tcp_col(pairs)] = row.pop("tcp")
    return row


def run(total: int, reps: int, backends: list[str], out: Callable[[str], None],
        report: br.Report | None = None, processes: int = 1,
        width: int = 0, remote: NetPeer | None = None) -> list[dict[str, float | str]]:
    """Measure every case, print one markdown table and its legend; return GB/s per case.

    `processes=2` puts every receiving endpoint except loopback's (an
    in-process backend by definition) in a child process; `remote` (the
    two-host mode) puts them on the `--listen` host instead, and closes it at
    the end. A table wider than `width` prints as several, each led by `case`.
    """
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    local = LocalPeer(total)
    if remote is None:
        remote = local if processes == 1 else ChildPeer(total)
    columns = ["case", "memcpy", "memcpy/seg"]
    pairs: dict[str, _EnginePair] = {}
    nixls: dict[str, RawNixlPair] = {}
    raw = None
    results: list[dict[str, float | str]] = []
    try:
        raw = _pairs(backends, src, local, remote, columns, pairs, nixls)
        if report is not None:  # where each receiving endpoint listened: the two-host check
            report.data["endpoints"] = {**{k: p.where for k, p in pairs.items()},
                                        **({"raw socket": raw.where} if raw else {})}
        methods = len(pairs) + len(nixls) + 2 + (raw is not None)
        seconds = estimate(total, reps, methods, 1 + (raw is not None))
        out(f"# {len(SEGMENTS) * 2} cases x {methods} methods x {reps + 1} runs (one warm-up): "
            f"about {_duration(seconds)} on this machine (rough; the progress line refines it)")
        emit = br.markdown(columns, out, width)
        # One step per round of every method, so a long case shows progress too.
        progress = br.Progress(len(SEGMENTS) * 2 * (reps + 1), "rounds")
        for seg in SEGMENTS:
            for shuffled in (False, True):
                table = _table(total, seg, shuffled, rng)
                name = f"{total // seg} x {_size(seg)} {'shuffled' if shuffled else 'contiguous'}"
                times = _measure(_runs(src, local, table, pairs, raw, nixls), reps,
                                 lambda i, name=name: progress.step(
                                     f"{name}: {'warm-up' if not i else f'run {i} of {reps}'}"))
                gbs = {k: total / statistics.median(t) / 1e9 for k, t in times.items()}
                for method, seconds in times.items():
                    if report is not None:
                        report.sample(case=name, segment_bytes=seg, shuffled=shuffled,
                                      method=method, seconds=seconds, bytes=total)
                results.append({"case": name, "segment_bytes": seg, "shuffled": shuffled, **gbs})
                emit(_row(name, gbs, pairs, table))
        emit.close()
        streams = pairs["tcp"].tx.streams if "tcp" in pairs else 0
        meanings = legend(columns, streams, processes,
                          remote.address if isinstance(remote, NetPeer) else "")
        if report is not None:
            report.finish(meanings, columns, results, out)
        else:
            br.print_legend(meanings, columns, out)
    finally:
        for closing in [*pairs.values(), *nixls.values(), *([raw] if raw else [])]:
            closing.close()
        if remote is not local:
            remote.close()
        local.close()
    return results


def plot(results: list[dict], path, note: str) -> None:
    """GB/s against segment size per method, contiguous and shuffled panels, memcpy dashed."""
    methods = [k for k in results[0] if k not in ("case", "segment_bytes", "shuffled")]

    def draw(plt) -> None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for ax, shuffled in zip(axes, (False, True), strict=True):
            mine = sorted((r for r in results if r["shuffled"] == shuffled),
                          key=lambda r: r["segment_bytes"])
            xs = [r["segment_bytes"] for r in mine]
            for m in methods:  # colour and marker per method: report.unify
                ax.plot(xs, [r[m] for r in mine], label=m, ls="--" if m == "memcpy" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(xs, [_size(x) for x in xs])  # 4 KiB, 64 KiB, 4 MiB
            ax.minorticks_off()
            ax.set_xlabel("segment size")
            ax.set_title("shuffled destinations" if shuffled else "contiguous", fontsize=9)
        axes[0].set_ylabel("GB/s (log)")

    br.figure(path, draw, "pdxfer bench transport: GB/s against segment size", note)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench transport`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench transport", description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=bounded_int(4, 1 << 16), default=256,
                        help="bytes moved per case, MiB (4..65536: at least one 4 MiB segment)")
    parser.add_argument("--reps", type=bounded_int(1, 10_000), default=5, help="timed runs per figure (median)")
    parser.add_argument("--quick", action="store_true", help="32 MiB per case, for a short run")
    parser.add_argument("--tiny", action="store_true",
                        help="4 MiB per case, one run each, loopback and tcp unless --backends says: "
                             "a smoke run in seconds")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backends (default: every installed one)")
    parser.add_argument("--processes", type=bounded_int(1, 2), default=1,
                        help="2: receivers in a child process, as deployed (default 1: one process)")
    add_two_host_args(parser)
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    total = (4 if args.tiny else 32 if args.quick else args.total_mib) * MiB
    reps = 1 if args.tiny else args.reps
    backends = br.backends_arg(parser, args.backends, variants=True, tiny=args.tiny)  # + nixl-all
    check_two_host_args(parser, args)
    br.check_outputs(parser, args)
    # What both hosts must agree on (the hello compares them).
    same = {"total_bytes": total, "reps": reps, "backends": backends}
    if args.listen is not None:
        return listen(*args.listen, "transport", same, lambda host: Receiver(total, host),
                      OPS, log)
    remote = None
    if args.connect is not None:
        try:
            remote = NetPeer(*args.connect, "transport", same)
        except MismatchError as exc:
            parser.error(f"--connect {args.connect[0]}:{args.connect[1]}: {exc}")
    where = (f"receiving on {remote.address}" if remote is not None else
             f"{args.processes} process{'es' if args.processes > 1 else ''}")
    report = br.Report("transport", backends,
                       {"total_bytes": total, "reps": reps, "processes": args.processes,
                        "connect": remote.address if remote is not None else None})
    print(f"# pdxfer bench transport: {total // MiB} MiB per case, median of {reps} runs, GB/s, "
          f"{where}")
    print(br.machine_line())
    results = run(total, reps, backends, lambda line: print(line, flush=True), report,
                  args.processes, br.terminal_width(args.width), remote)
    report.write(args.json, report.data["columns"])
    if args.plot is not None:
        plot(results, args.plot, report.note(f"{total // MiB} MiB per case, median of {reps}, "
                                             f"{args.processes} process(es)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
