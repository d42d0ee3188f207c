"""`pdxfer bench scaling`: GB/s and µs per request against request size, entry- vs layer-major.

Where does the per-segment cost stop mattering? One request is planned
(`layout.plan_segments`), written and awaited, alone, at sizes from one KV
page to 1,024 pages (64 KiB pages: 8 layers x K and V, scattered on both
sides as a paged allocator hands them out) and from one 64 KiB state entry
to one 32 MiB entry (8 layers x 2 fields), in an `EntryMajorArena` (one
segment per run of entries) and in a `LayerMajorArena` (one per field x
layer x run: 16x the rows). Each figure is the median of `--reps` requests
after a warm-up, the two layouts taking turns; the destination buffer is
checked by crc32 after each layout's warm-up (the timed requests rewrite
the same bytes).

With `--processes 2` the receiving engine lives in a child process
(`bench/peer.py`), as deployed; the prefill side plans against a local copy of
the destination arena's geometry, which is all planning reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib

import numpy as np
import torch

from pdxfer import layout, transport

from ..cliargs import bounded_int
from . import report as br
from .peer import CHILD_NOTE, ChildPeer, LocalPeer, crosses_processes

KiB, MiB = 1 << 10, 1 << 20
LAYERS = 8
PAGES = (1, 4, 16, 64, 256, 1024)
STATE_BYTES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB)
LAYOUTS = {"entry-major": layout.EntryMajorArena, "layer-major": layout.LayerMajorArena}


def _fields(entry_bytes: int) -> list[layout.EntryField]:
    """Two fields x LAYERS layers making one entry of `entry_bytes` (fp16 K/V or fp32 state)."""
    per = entry_bytes // (2 * LAYERS)
    return [layout.EntryField("a", LAYERS, (per // 2,), torch.float16),
            layout.EntryField("b", LAYERS, (per // 2,), torch.float16)]


def cases(tiny: bool) -> list[tuple[str, int, int, int]]:
    """(pool, entries per request, entry bytes, entries in the arena) for every point of the curve."""
    pages = PAGES[:3] if tiny else PAGES
    states = STATE_BYTES[:2] if tiny else STATE_BYTES
    arena_pages = max(pages)
    out = [("kv pages", n, 64 * KiB, arena_pages) for n in pages]
    out += [("state entry", 1, b, 2) for b in states]
    return out


def _expected(src: np.ndarray, size: int, table: np.ndarray) -> int:
    out = np.zeros(size, dtype=np.uint8)
    for s, d, n in table.tolist():
        out[d:d + n] = src[s:s + n]
    return zlib.crc32(out)


def _point(backend: str, tx: transport.TransportEngine, conn, far: dict, peer, pool: str, n: int,
           entry: int, entries: int, reps: int, rng: np.random.Generator) -> list[dict]:
    """Both layouts at one request size: per-request seconds, segments, bytes."""
    fields = _fields(entry)
    src_idx = rng.permutation(entries)[:n]
    dst_idx = rng.permutation(entries)[:n]
    arenas, regions, tables = {}, {}, {}
    for name, cls in LAYOUTS.items():
        arena = cls(fields, entries, "cpu")
        arena.buf.copy_(torch.from_numpy(rng.integers(0, 256, arena.buf.numel(), dtype=np.uint8)))
        arenas[name] = arena
        regions[name] = tx.register(arena.buf)
        tables[name] = layout.plan_segments(arena, src_idx, dst_idx, dst_entries=entries)[0]
    size = max(a.buf.numel() for a in arenas.values())
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    try:
        for name in LAYOUTS:  # warm-up and check: the planned bytes, and only them, land
            peer.call("zero")
            conn.write(regions[name], far, tables[name]).wait(120)
            crc = peer.call("crc", size=size)
            if crc != _expected(arenas[name].buf.numpy(), size, tables[name]):
                raise SystemExit(f"{backend} {pool} x{n} {name}: wrong bytes landed")
        for _ in range(reps):
            for name in LAYOUTS:
                t = time.perf_counter()
                table = layout.plan_segments(arenas[name], src_idx, dst_idx, dst_entries=entries)[0]
                conn.write(regions[name], far, table).wait(120)
                times[name].append(time.perf_counter() - t)
    finally:
        for r in regions.values():
            tx.deregister(r)
    nbytes = n * entry
    return [{"backend": backend, "pool": pool, "entries": n, "entry_bytes": entry, "bytes": nbytes,
             "layout": name, "segments": int(tables[name].shape[0]), "seconds": times[name],
             "us": statistics.median(times[name]) * 1e6,
             "gbs": nbytes / statistics.median(times[name]) / 1e9} for name in LAYOUTS]


def run(backends: list[str], reps: int, tiny: bool, processes: int, out, report: br.Report,
        width: int = 0) -> list[dict]:
    """Every backend x request size x layout; print one table and its legend, return the rows."""
    rng = np.random.default_rng(0)
    points = cases(tiny)
    biggest = max(max(e * (n if p == "kv pages" else 2), e * entries)
                  for p, n, e, entries in points)
    columns = ["backend", "pool", "request", "layout", "segments", "us/request", "GB/s", "layer/entry"]
    emit = br.markdown(columns, out, width, keys=4)
    rows: list[dict] = []
    progress = br.Progress(len(points) * len(backends), "points")
    for backend in backends:
        local = LocalPeer(biggest + 4 * MiB)
        cross = processes == 2 and crosses_processes(backend)
        peer = ChildPeer(biggest + 4 * MiB) if cross else local
        tx = transport.create(backend)
        try:
            far = peer.call("engine", backend=backend, options={})
            conn = tx.connect(far["address"])
            for pool, n, entry, entries in points:
                pair = _point(backend, tx, conn, far["descriptor"], peer, pool, n, entry, entries, reps, rng)
                ratio = pair[0]["gbs"] and pair[1]["gbs"] / pair[0]["gbs"]
                for r in pair:
                    rows.append(r)
                    report.sample(**{k: v for k, v in r.items() if k != "us" and k != "gbs"})
                    emit({"backend": backend, "pool": pool,
                          "request": f"{n} x {_size(entry)}", "layout": r["layout"],
                          "segments": str(r["segments"]), "us/request": f"{r['us']:.0f}",
                          "GB/s": f"{r['gbs']:.2f}",
                          "layer/entry": f"{ratio:.2f}x" if r["layout"] == "layer-major" else ""})
                progress.step(f"{backend} {pool} x{n}")
        finally:
            tx.close()
            if peer is not local:
                peer.close()
            local.close()
    emit.close()
    meanings = {
        "backend": "transport backend of both engines" + (CHILD_NOTE if processes == 2 else ""),
        "pool": "kv pages: 64 KiB pages scattered on both sides; state entry: one entry of the stated size",
        "request": "entries per request x bytes per entry",
        "layout": "entry-major (EntryMajorArena) or layer-major (LayerMajorArena: one row per field x layer x run)",
        "segments": "rows of the planned segment table",
        "us/request": "median wall us of plan_segments + write + wait for one request",
        "GB/s": "request bytes over that time, 10^9 B/s",
        "layer/entry": "layer-major GB/s over entry-major GB/s at the same size",
    }
    report.finish(meanings, columns, [{k: v for k, v in r.items() if k != "seconds"} for r in rows], out)
    return rows


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def plot(rows: list[dict], path, note: str) -> None:
    """GB/s (top) and time per request (bottom) against request bytes; KV pages and state entries."""

    def draw(plt) -> None:
        _, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex="col")
        for col, pool in enumerate(("kv pages", "state entry")):
            for backend in sorted({r["backend"] for r in rows}):
                for name, style in (("entry-major", "-o"), ("layer-major", "--s")):
                    mine = sorted((r for r in rows if r["pool"] == pool and r["backend"] == backend
                                   and r["layout"] == name), key=lambda r: r["bytes"])
                    xs = [r["bytes"] / KiB for r in mine]
                    axes[0][col].plot(xs, [r["gbs"] for r in mine], style, label=f"{backend} {name}")
                    axes[1][col].plot(xs, [r["us"] / 1e6 for r in mine], style, label=f"{backend} {name}")
            axes[0][col].set_title(pool + (" (64 KiB each)" if pool == "kv pages" else " (one entry)"),
                                   fontsize=9)
            axes[1][col].set_xlabel("request size")
            for ax in (axes[0][col], axes[1][col]):
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                br.bytes_axis(ax, KiB)  # 64 KiB, 1 MiB, not 2^6
            br.time_axis(axes[1][col])  # 250 µs, 12 ms
        axes[0][0].set_ylabel("GB/s (log)")
        axes[1][0].set_ylabel("time per request (log)")

    br.figure(path, draw, "pdxfer bench scaling: request size vs GB/s and time, entry- vs layer-major",
              note)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench scaling`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=bounded_int(1, 10_000), default=7, help="timed requests per point (median)")
    parser.add_argument("--tiny", action="store_true", help="three small points per pool, for a smoke run")
    parser.add_argument("--backends", default="loopback,tcp", help="comma-separated backends")
    parser.add_argument("--processes", type=bounded_int(1, 2), default=1,
                        help="2: the receiving engine in a child process, as deployed")
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    backends = br.backends_arg(parser, args.backends)
    br.check_outputs(parser, args)
    report = br.Report("scaling", backends, {"reps": args.reps, "processes": args.processes})
    print(f"# pdxfer bench scaling: median of {args.reps} requests per point, {args.processes} process(es)")
    print(br.machine_line())
    rows = run(backends, args.reps, args.tiny, args.processes, lambda line: print(line, flush=True),
               report, br.terminal_width(args.width))
    report.write(args.json, report.data["columns"])
    if args.plot is not None:
        plot(rows, args.plot, report.note(f"median of {args.reps}, {args.processes} process(es)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
