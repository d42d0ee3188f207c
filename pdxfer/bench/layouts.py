"""`pdxfer bench layouts`: one model state shipped three ways, on every backend.

The question a serving engine faces before adopting entry-major arenas: what
does its current layout cost on the wire, and would a staging copy hide it?
For each model state below, on each backend, in one run:

- `whole entries`: an `EntryMajorArena` (SGLang's page-major pools ship the
  same way): one segment per run of entries consecutive on both sides;
- `layer-major`: the same fields in a `LayerMajorArena`, today's paged-KV
  shape: one segment per field x layer x run;
- `staging`: the layer-major segments gathered into one contiguous staging
  buffer, shipped as ONE segment into the receiver's staging buffer, and
  scattered into its layer-major arena (what connectors do to hide segment
  counts; it pays two local copies instead). The gather and scatter are one
  numpy slice copy per segment on the CPU: a GPU connector would use one
  kernel, but the copies and their bytes are the same.

Model states:
- `example`: one request of the example hybrid model (`pdxfer layout
  --example`): 16 KV pages in 4 runs, its GDN slot and its compressor slot;
- `llama-8b`: Llama-3-8B-like KV pages (32 layers, 8 KV heads, head_dim
  128, bf16, page 16: 2 MiB a page), 8 scattered pages;
- `deepseek-v4`: a DeepSeek-V4-sized compressor state entry, 47 layers of
  CSA/HCA/indexer kv_state + score_state rings, fp32: 26.6 MB in one entry.

Every method's destination is checked against the source after its warm-up
run; the figures are medians of `--reps` runs with the methods taking turns,
so load from other processes hits all alike. `memcpy` is one copy of the
same number of contiguous bytes in this process: the ceiling for loopback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdxfer import transport
from pdxfer.layout import EntryField, EntryMajorArena, LayerMajorArena, plan_segments

from .. import layout_example as ex
from ..cliargs import bounded_int
from . import report as br

METHODS = ("whole entries", "layer-major", "staging")

COLUMNS = {
    "model": "the model state shipped (see `pdxfer bench layouts --help`)",
    "backend": "transport backend both engines use",
    "method": "whole entries (entry-major arena), layer-major (one segment per field x layer "
              "x run), staging (layer-major gathered into one buffer, one segment, scattered)",
    "segments": "rows of the segment table(s) the transport is handed per request",
    "MB": "payload bytes per request, 10^6 bytes",
    "copied MB": "bytes copied locally besides the transfer (staging: gather + scatter)",
    "wall ms": "median wall time of one request: plan, (gather,) write until complete, (scatter)",
    "GB/s": "payload bytes / wall time",
    "vs whole": "this method's wall time over whole entries' on the same backend (<1 is faster)",
    "memcpy GB/s": "one contiguous copy of the same bytes in this process (loopback's ceiling)",
}


@dataclass
class Pool:
    """One pool of a model state: its fields and the entries one request ships."""

    name: str
    fields: list[EntryField]
    src: np.ndarray
    dst: np.ndarray

    @property
    def entries(self) -> tuple[int, int]:
        return int(self.src.max()) + 1, int(self.dst.max()) + 1


def _ds_fields(layers: int) -> list[EntryField]:
    out = []
    for flavor, ring, width in (("csa", 8, 512), ("hca", 128, 512), ("idx", 8, 128)):
        out.append(EntryField(f"{flavor}_kv_state", layers, (ring, width), torch.float32))
        out.append(EntryField(f"{flavor}_score_state", layers, (ring, width), torch.float32,
                              fill=float("-inf")))
    return out


def _shrunk(fields: list[EntryField], layers: int | None) -> list[EntryField]:
    if layers is None:
        return fields
    return [EntryField(f.name, min(f.layers, layers), f.shape, f.dtype, f.fill) for f in fields]


def models(tiny: bool) -> dict[str, list[Pool]]:
    """Every model state, or a two-layer, few-page version of each for a smoke run."""
    cap = 2 if tiny else None
    kv_src = np.array([3, 4, 5, 6, 9, 10, 11, 12, 20, 21, 22, 23, 30, 31, 32, 33])
    if tiny:
        kv_src = kv_src[:6]
    pages = np.array([1, 4, 7, 10, 13, 16, 19, 22])[: 3 if tiny else 8]
    llama = [EntryField(n, 32, (16, 8, 128), torch.bfloat16) for n in ("k", "v")]
    slot = (np.array([1]), np.array([0]))
    return {
        "example": [Pool("kv", _shrunk(ex.kv_fields(), cap), kv_src, np.arange(kv_src.size)),
                    Pool("gdn", _shrunk(ex.gdn_fields(), cap), *slot),
                    Pool("compressor", _shrunk(ex.compressor_fields(), cap), *slot)],
        "llama-8b": [Pool("kv", _shrunk(llama, cap), pages, np.arange(pages.size))],
        "deepseek-v4": [Pool("state", _ds_fields(cap or 47), *slot)],
    }


class _Side:
    """Both layouts of every pool of a model on one side, and a staging buffer, registered."""

    def __init__(self, engine: transport.TransportEngine, pools: list[Pool], src: bool) -> None:
        self.arenas: dict[str, dict[str, EntryMajorArena | LayerMajorArena]] = {"whole": {}, "layer": {}}
        self.regions: dict[str, dict[str, object]] = {"whole": {}, "layer": {}}
        gen = torch.Generator().manual_seed(0 if src else 1)
        payload = 0
        for pool in pools:
            n = pool.entries[0 if src else 1]
            for kind, cls in (("whole", EntryMajorArena), ("layer", LayerMajorArena)):
                arena = cls(pool.fields, n, "cpu")
                if src:
                    for f in pool.fields:
                        view = arena.view(f.name)
                        view.copy_(torch.randint(-99, 99, view.shape, generator=gen).to(f.dtype))
                self.arenas[kind][pool.name] = arena
                self.regions[kind][pool.name] = engine.register(arena.buf)
            payload += sum(f.bytes_per_entry for f in pool.fields) * pool.src.size
        self.staging = torch.zeros(payload, dtype=torch.uint8)
        self.staging_region = engine.register(self.staging)


def _copy_rows(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> None:
    for s, d, n in rows:
        dst[d:d + n] = src[s:s + n]


class _Run:
    """One model on one backend: the three methods as callables, each checkable."""

    def __init__(self, backend: str, pools: list[Pool]) -> None:
        self.pools = pools
        self.tx, self.rx = transport.create(backend), transport.create(backend)
        try:
            self.a, self.b = _Side(self.tx, pools, True), _Side(self.rx, pools, False)
            self.remote = {k: {p: r.descriptor() for p, r in v.items()} for k, v in self.b.regions.items()}
            self.remote_staging = self.b.staging_region.descriptor()
            self.conn = self.tx.connect(self.rx.address())
        except BaseException:
            self.close()
            raise

    def plan(self, kind: str) -> dict[str, np.ndarray]:
        arenas, dst = self.a.arenas[kind], self.b.arenas[kind]
        return {p.name: plan_segments(arenas[p.name], p.src, p.dst,
                                      dst_entries=dst[p.name].entries)[0] for p in self.pools}

    def direct(self, kind: str) -> None:
        handles = [self.conn.write(self.a.regions[kind][name], self.remote[kind][name], table)
                   for name, table in self.plan(kind).items()]
        for h in handles:
            h.wait(120)

    def staging(self) -> None:
        tables, at = self.plan("layer"), 0
        stage, moves = self.a.staging.numpy(), []
        for name, table in tables.items():
            rows = table.tolist()
            sizes = np.cumsum([0] + [n for _, _, n in rows])
            _copy_rows(self.a.arenas["layer"][name].buf.numpy(), stage,
                       [(s, at + int(o), n) for (s, _, n), o in zip(rows, sizes, strict=False)])
            moves.append((name, rows, at + sizes[:-1]))
            at += int(sizes[-1])
        one = np.array([[0, 0, at]], dtype=np.int64)
        self.conn.write(self.a.staging_region, self.remote_staging, one).wait(120)
        landed = self.b.staging.numpy()
        for name, rows, offs in moves:
            _copy_rows(landed, self.b.arenas["layer"][name].buf.numpy(),
                       [(int(o), d, n) for (_, d, n), o in zip(rows, offs, strict=True)])

    def segments(self, method: str) -> int:
        if method == "staging":
            return 1
        return sum(len(t) for t in self.plan("whole" if method == "whole entries" else "layer").values())

    def check(self, method: str) -> None:
        """The named entries arrived intact (NaN-free data, so == is exact)."""
        kind = "whole" if method == "whole entries" else "layer"
        for p in self.pools:
            src, dst = self.a.arenas[kind][p.name], self.b.arenas[kind][p.name]
            for f in p.fields:
                if not torch.equal(dst.view(f.name)[:, p.dst], src.view(f.name)[:, p.src]):
                    raise SystemExit(f"{method}: pool {p.name} field {f.name} arrived wrong")

    def reset(self) -> None:
        for kind in ("whole", "layer"):
            for arena in self.b.arenas[kind].values():
                arena.buf.zero_()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def _measure(run: _Run, reps: int) -> dict[str, list[float]]:
    methods = {"whole entries": lambda: run.direct("whole"), "layer-major": lambda: run.direct("layer"),
               "staging": run.staging}
    run.reset()
    for name, fn in methods.items():  # warm-up, then checked
        fn()
        run.check(name)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _memcpy_s(nbytes: int, reps: int) -> list[float]:
    a, b = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(b, a)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        out.append(time.perf_counter() - t0)
    return out


def run(backends: list[str], reps: int, tiny: bool, report: br.Report, width: int = 0) -> list[dict]:
    """Measure every model x backend x method; print the table; return its rows as numbers."""
    states = models(tiny)
    shown = list(COLUMNS)
    emit = br.markdown(shown, lambda line: print(line, flush=True), width, keys=3)
    progress = br.Progress(len(states) * len(backends) * len(METHODS))
    rows = []
    for model, pools in states.items():
        nbytes = sum(sum(f.bytes_per_entry for f in p.fields) * p.src.size for p in pools)
        mem = _memcpy_s(nbytes, reps)
        report.sample(model=model, backend="-", method="memcpy", seconds=mem, bytes=nbytes)
        for backend in backends:
            r = _Run(backend, pools)
            try:
                times = _measure(r, reps)
                segs = {m: r.segments(m) for m in METHODS}
            finally:
                r.close()
            whole = statistics.median(times["whole entries"])
            for method in METHODS:
                wall = statistics.median(times[method])
                copied = 2 * nbytes if method == "staging" else 0
                row = {"model": model, "backend": backend, "method": method,
                       "segments": segs[method], "bytes": nbytes, "copied": copied,
                       "wall_s": wall, "gbs": nbytes / wall / 1e9, "vs_whole": wall / whole,
                       "memcpy_gbs": nbytes / statistics.median(mem) / 1e9}
                report.sample(model=model, backend=backend, method=method, seconds=times[method],
                              bytes=nbytes, segments=segs[method], copied=copied)
                report.row(row)
                rows.append(row)
                emit({"model": model, "backend": backend, "method": method,
                      "segments": str(row["segments"]), "MB": f"{nbytes / 1e6:.2f}",
                      "copied MB": f"{copied / 1e6:.2f}", "wall ms": f"{wall * 1e3:.2f}",
                      "GB/s": f"{row['gbs']:.2f}", "vs whole": f"{row['vs_whole']:.2f}x",
                      "memcpy GB/s": f"{row['memcpy_gbs']:.2f}"})
                progress.step(f"{model} {backend} {method}")
    emit.close()
    br.print_legend(COLUMNS, shown)
    return rows


def plot(rows: list[dict], path, note: str) -> None:
    """GB/s per method, grouped by backend, one panel per model, memcpy dashed."""
    model_names = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))

    def draw(plt) -> None:
        _, axes = plt.subplots(1, len(model_names), figsize=(4.2 * len(model_names), 3.6), squeeze=False)
        width = 0.8 / len(METHODS)
        for ax, model in zip(axes[0], model_names, strict=True):
            mine = [r for r in rows if r["model"] == model]
            values = [mine[0]["memcpy_gbs"]]
            for k, method in enumerate(METHODS):
                ys = [next(r["gbs"] for r in mine if r["backend"] == b and r["method"] == method)
                      for b in backends]
                values += ys
                ax.bar(np.arange(len(backends)) + (k - 1) * width, ys, width, label=method)
            ax.axhline(mine[0]["memcpy_gbs"], ls="--", c="grey", lw=1, label="memcpy")
            ax.set_xticks(np.arange(len(backends)), backends)
            segs = " / ".join(str(next(r["segments"] for r in mine if r["method"] == m))
                              for m in METHODS)
            ax.set_title(f"{model}: {mine[0]['bytes'] / 1e6:.1f} MB / request\n"
                         f"segments {segs}", fontsize=8)
            ax.set_ylabel("GB/s")
            br.log_if_dwarfed(ax, values)

    br.figure(path, draw, "pdxfer bench layouts: one model state shipped three ways "
              f"({' / '.join(METHODS)})", note)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench layouts`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench layouts", description=__doc__.split("\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=bounded_int(1, 1000), default=5, help="timed runs per figure (median)")
    parser.add_argument("--tiny", action="store_true",
                        help="two layers and a few pages per model, loopback and tcp unless --backends "
                             "says: a smoke run of every path")
    parser.add_argument("--backends", default=None, help="comma-separated (default: every installed one)")
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    backends = br.backends_arg(parser, args.backends, tiny=args.tiny)
    br.check_outputs(parser, args)
    report = br.Report("layouts", backends, {"reps": args.reps, "tiny": args.tiny})
    print(f"# pdxfer bench layouts: median of {args.reps} runs{' (tiny)' if args.tiny else ''}")
    print(br.machine_line())
    rows = run(backends, args.reps, args.tiny, report, br.terminal_width(args.width))
    report.write(args.json, COLUMNS)
    if args.plot is not None:
        m = report.data["machine"]
        plot(rows, args.plot, f"{m['host']}, {m['cores']} cores, load average "
             f"{m['loadavg'][0]:.1f} (a shared, loaded machine: compare bars within a panel), "
             f"median of {args.reps}{', tiny' if args.tiny else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
