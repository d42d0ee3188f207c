"""`pdxfer bench tp`: heterogeneous-TP transfers, shard-major vs per-token/per-head slicing.

One request of `--pages` pages of a paged-KV pool (`--layers` layers of k
and v, `--heads` KV heads of `--head-dim`, bf16, 16 tokens a page) moves from
a prefill group at TP=P to a decode group at TP=D, for each (P, D) case.
Two ways, over the same pool sizes and the same bytes:

- `shard-major`: `layout.ShardMajorArena` pools, `layout.plan_rank_pair`
  tables — one segment per entry per contributing rank pair (merged runs);
- `per-token`: the layout serving engines use today (one `[pages, page_size,
  local heads, dim]` tensor per layer and field, `LayerMajorArena`) and what
  their hetero-TP path ships: one segment per token x head group (the pair's
  overlapping heads) x layer x field.

Per case and method: segments per request, planning time, and GB/s of one
loopback (and tcp) `write` per rank pair, posted together and waited for —
the median of `--reps` runs after a warm-up, methods taking turns within a
repetition; beside them one memcpy of the same bytes, the ceiling. Before timing, every method's result is checked against the
global K/V it must reassemble, so a fast wrong number cannot be printed.
Segments for shard-major are asserted to be entries x contributing pairs.
This is a benchmark, not a test: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pdxfer import layout, transport

from ..cliargs import bounded_int
from . import report as br

CASES = ((4, 2), (2, 4), (8, 1), (1, 8))
PAGE = 16


def _fields(layers: int, heads: int, dim: int, tp_axis: int | None) -> list[layout.EntryField]:
    return [layout.EntryField(n, layers, (PAGE, heads, dim), torch.bfloat16, tp_axis=tp_axis)
            for n in ("k", "v")]


class _Side:
    """One method's pools for every rank of a (P, D) case, plus its tables."""

    def __init__(self, method: str, args: argparse.Namespace, P: int, D: int,
                 values: dict[str, torch.Tensor]) -> None:
        self.method = method
        L, H, Dh = args.layers, args.heads, args.head_dim
        entries = args.pages
        if method == "shard-major":
            make = lambda tp, r: layout.ShardMajorArena(_fields(L, H, Dh, 1), entries, "cpu",  # noqa: E731
                                                       tp=tp, rank=r)
        else:
            make = lambda tp, r: layout.LayerMajorArena(_fields(L, H // tp, Dh, None), entries, "cpu")  # noqa: E731
        self.src = [make(P, p) for p in range(P)]
        self.dst = [make(D, q) for q in range(D)]
        for p, arena in enumerate(self.src):
            per = H // P
            for name in ("k", "v"):
                arena.view(name).copy_(values[name][:, :, :, p * per:(p + 1) * per])
        self.P, self.D, self.H = P, D, H
        # What an engine's handshake builds once per (pool, peer): not per request.
        self.pairs = {(p, q): layout.rank_pair(self.src[p], layout.describe(self.dst[q]))
                      for q in range(D) for p in layout.contributing_ranks(P, D, q)
                      } if method == "shard-major" else {}

    def plan(self, src_idx: np.ndarray, dst_idx: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """`(p, q, table)` for every contributing pair."""
        out = []
        for q, dst in enumerate(self.dst):
            for p in layout.contributing_ranks(self.P, self.D, q):
                if self.method == "shard-major":
                    pair = self.pairs[p, q]
                    table, = (pair.plan(src_idx, dst_idx, dst_entries=dst.entries) if pair
                              else layout.plan_segments(self.src[p], src_idx, dst_idx))
                else:
                    table = self._per_token(p, q, src_idx, dst_idx)
                out.append((p, q, table))
        return out

    def _per_token(self, p: int, q: int, src_idx: np.ndarray, dst_idx: np.ndarray) -> np.ndarray:
        """One row per token x layer x field: the pair's overlapping heads of that token."""
        src, dst = self.src[p], self.dst[q]
        hp, hq = self.H // self.P, self.H // self.D
        lo, hi = max(p * hp, q * hq), min((p + 1) * hp, (q + 1) * hq)
        head = src.fields[0].shape[2] * src.fields[0].dtype.itemsize
        parts = []
        for arena_field_s, arena_field_d in zip(src.fields, dst.fields, strict=True):
            base_s = src.field_offset(arena_field_s.name) * src.entries
            base_d = dst.field_offset(arena_field_d.name) * dst.entries
            layer = np.arange(arena_field_s.layers)[:, None, None]
            tok = np.arange(PAGE)[None, None, :]
            s = (base_s + (layer * src.entries + src_idx[None, :, None]) * arena_field_s.per_layer_bytes
                 + tok * hp * head + (lo - p * hp) * head)
            d = (base_d + (layer * dst.entries + dst_idx[None, :, None]) * arena_field_d.per_layer_bytes
                 + tok * hq * head + (lo - q * hq) * head)
            parts.append(np.stack([s.ravel(), d.ravel(), np.full(s.size, (hi - lo) * head)], 1))
        return np.concatenate(parts).astype(np.int64)

    def check(self, values: dict[str, torch.Tensor], src_idx: np.ndarray, dst_idx: np.ndarray) -> None:
        per = self.H // self.D
        for q, arena in enumerate(self.dst):
            for name in ("k", "v"):
                got = arena.view(name)[:, dst_idx]
                want = values[name][:, src_idx][:, :, :, q * per:(q + 1) * per]
                if not torch.equal(got, want):
                    raise SystemExit(f"{self.method}: decode rank {q} field {name} is wrong")

    def clear(self) -> None:
        for arena in self.dst:
            arena.buf.zero_()


class _Links:
    """One transport engine per rank, every buffer registered once, a link per pair."""

    def __init__(self, backend: str, side: _Side) -> None:
        self.engines = []
        try:
            self.tx = [self._engine(backend) for _ in side.src]
            self.rx = [self._engine(backend) for _ in side.dst]
            self.local = [e.register(a.buf) for e, a in zip(self.tx, side.src, strict=True)]
            self.remote = [e.register(a.buf).descriptor() for e, a in zip(self.rx, side.dst, strict=True)]
            self.conn = {(p, q): self.tx[p].connect(self.rx[q].address())
                         for p in range(len(side.src)) for q in range(len(side.dst))}
        except BaseException:
            self.close()
            raise

    def _engine(self, backend: str):
        engine = transport.create(backend)
        self.engines.append(engine)
        return engine

    def move(self, tables: list[tuple[int, int, np.ndarray]]) -> None:
        handles = [self.conn[p, q].write(self.local[p], self.remote[q], t) for p, q, t in tables]
        for h in handles:
            h.wait(300)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def legend(backends: list[str]) -> dict[str, str]:
    """What each column means, for the backends measured."""
    out = {
        "P -> D": "prefill TP size -> decode TP size",
        "method": "shard-major (ShardMajorArena, planned by layout.rank_pair) or per-token "
                  "(LayerMajorArena per rank, one segment per token x head group x layer x field)",
        "pairs": "contributing (prefill rank, decode rank) pairs: one transfer each",
        "segments": "rows of all the pairs' tables for one request",
        "plan us": "median us planning every pair of the request (after a warm-up call)",
    }
    for b in backends:
        out[f"{b} GB/s"] = f"request bytes over the time of all its {b} writes, posted together"
    for b in backends:
        out[f"{b} speed-up"] = f"{b} GB/s over per-token's {b} GB/s in the same run"
    out["memcpy GB/s"] = "one numpy.copyto of the same number of bytes, taking turns with the methods"
    out[f"{backends[0]}/memcpy"] = f"{backends[0]} GB/s over memcpy GB/s"
    return out


def run(args: argparse.Namespace, out: Callable[[str], None], report: br.Report,
        width: int = 0) -> list[dict]:
    """Measure every case; print one markdown table and its legend; return the rows as numbers."""
    L, H, Dh = args.layers, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn((L, args.pages, PAGE, H, Dh), generator=gen).to(torch.bfloat16)
              for n in ("k", "v")}
    rng = np.random.default_rng(0)
    src_idx = rng.permutation(args.pages)[: args.request].astype(np.int64)
    dst_idx = rng.permutation(args.pages)[: args.request].astype(np.int64)
    meanings = legend(args.backends)
    columns = list(meanings)
    emit = br.markdown(columns, out, width, keys=2)
    progress = br.Progress(len(CASES) * len(args.backends), "case x backend")
    rows: list[dict] = []
    for P, D in CASES:
        sides = {m: _Side(m, args, P, D, values) for m in ("shard-major", "per-token")}
        tables, plan_us, nbytes = {}, {}, {}
        for m, side in sides.items():
            spent = []
            for _ in range(args.reps + 1):  # the first call warms numpy's paths up
                t0 = time.perf_counter()
                tables[m] = side.plan(src_idx, dst_idx)
                spent.append(time.perf_counter() - t0)
            plan_us[m] = statistics.median(spent[1:]) * 1e6
            nbytes[m] = sum(int(t[:, 2].sum()) for _, _, t in tables[m])
        pairs = len(tables["shard-major"])
        seg = sum(len(t) for _, _, t in tables["shard-major"])
        if seg != args.request * pairs or nbytes["shard-major"] != nbytes["per-token"]:
            raise SystemExit(f"{P}->{D}: {seg} segments for {args.request} entries x {pairs} pairs, "
                             f"or bytes differ ({nbytes})")
        gbs: dict[str, dict[str, float]] = {m: {} for m in sides}
        # The ceiling: one memcpy of the same bytes, taking its turn beside the methods.
        flat = np.ones(nbytes["shard-major"], dtype=np.uint8)
        sink = np.empty_like(flat)
        copies: list[float] = []
        for backend in args.backends:
            links = {m: _Links(backend, side) for m, side in sides.items()}
            try:
                for m, side in sides.items():  # correctness first, untimed
                    side.clear()
                    links[m].move(tables[m])
                    side.check(values, src_idx, dst_idx)
                times: dict[str, list[float]] = {m: [] for m in sides}
                for i in range(args.reps + 1):
                    for m in sides:
                        t0 = time.perf_counter()
                        links[m].move(tables[m])
                        if i:
                            times[m].append(time.perf_counter() - t0)
                    if backend == args.backends[0]:
                        t0 = time.perf_counter()
                        np.copyto(sink, flat)
                        if i:
                            copies.append(time.perf_counter() - t0)
                for m in sides:
                    gbs[m][backend] = nbytes[m] / statistics.median(times[m]) / 1e9
                    report.sample(case=f"{P}->{D}", method=m, backend=backend, seconds=times[m],
                                  bytes=nbytes[m])
            finally:
                for link in links.values():
                    link.close()
            progress.step(f"{P} -> {D} {backend}")
        report.sample(case=f"{P}->{D}", method="memcpy", backend="-", seconds=copies,
                      bytes=int(flat.size))
        memcpy = flat.size / statistics.median(copies) / 1e9
        for m in sides:
            segments = sum(len(t) for _, _, t in tables[m])
            row = {"case": f"{P}->{D}", "method": m, "pairs": pairs, "segments": segments,
                   "plan_us": plan_us[m], "bytes": nbytes[m], "memcpy_gbs": memcpy,
                   **{f"{b}_gbs": gbs[m][b] for b in args.backends},
                   **{f"{b}_speedup": gbs[m][b] / gbs["per-token"][b] for b in args.backends}}
            rows.append(row)
            b0 = args.backends[0]
            emit({"P -> D": f"{P} -> {D}", "method": m, "pairs": str(pairs),
                  "segments": f"{segments:,}", "plan us": f"{plan_us[m]:,.0f}",
                  **{f"{b} GB/s": f"{gbs[m][b]:.2f}" for b in args.backends},
                  **{f"{b} speed-up": f"{row[f'{b}_speedup']:.1f}x" for b in args.backends},
                  "memcpy GB/s": f"{memcpy:.2f}", f"{b0}/memcpy": f"{gbs[m][b0] / memcpy:.2f}x"})
    emit.close()
    report.finish(meanings, columns, rows, out)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench tp`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=bounded_int(1, 1024), default=16, help="layers (1..1024)")
    parser.add_argument("--heads", type=bounded_int(8, 1024), default=8,
                        help="KV heads, a multiple of 8 (TP up to 8)")
    parser.add_argument("--head-dim", type=bounded_int(1, 4096), default=128, help="head dim (1..4096)")
    parser.add_argument("--pages", type=bounded_int(1, 1 << 20), default=96, help="entries in every pool")
    parser.add_argument("--request", type=bounded_int(1, 1 << 20), default=32,
                        help="pages one request moves (at most --pages)")
    parser.add_argument("--reps", type=bounded_int(1, 1000), default=5, help="timed runs per figure (median)")
    parser.add_argument("--backends", default="loopback,tcp", help="comma-separated backends")
    parser.add_argument("--tiny", action="store_true",
                        help="2 layers, 6 pages, a 3-page request, one run: a smoke run of every case")
    br.add_output_args(parser, plot=False)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.pages, args.request, args.reps = 2, 6, 3, 1
    args.backends = br.backends_arg(parser, args.backends)
    if args.heads % 8:
        parser.error(f"--heads {args.heads}: must be a multiple of 8 (the cases go up to TP 8)")
    if args.request > args.pages:
        parser.error(f"--request {args.request} exceeds --pages {args.pages}: a request names "
                     "distinct pages of the pool")
    br.check_outputs(parser, args)
    report = br.Report("tp", args.backends, {
        "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim, "pages": args.pages,
        "request": args.request, "reps": args.reps, "page_tokens": PAGE})
    print(f"# pdxfer bench tp: {args.layers} layers x k,v x {args.heads} heads x {args.head_dim} "
          f"bf16, {PAGE}-token pages, {args.request}-page request, median of {args.reps}")
    print(br.machine_line())
    with br.torch_threads(1):
        run(args, lambda line: print(line, flush=True), report, br.terminal_width(args.width))
    report.write(args.json, report.data["columns"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
