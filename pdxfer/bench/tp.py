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
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pdxfer import layout, transport

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


def run(args: argparse.Namespace, out: Callable[[str], None]) -> None:
    """Measure every case and print one markdown table."""
    L, H, Dh = args.layers, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn((L, args.pages, PAGE, H, Dh), generator=gen).to(torch.bfloat16)
              for n in ("k", "v")}
    rng = np.random.default_rng(0)
    src_idx = rng.permutation(args.pages)[: args.request].astype(np.int64)
    dst_idx = rng.permutation(args.pages)[: args.request].astype(np.int64)
    cols = ["P -> D", "method", "pairs", "segments", "plan us"] + [f"{b} GB/s" for b in args.backends]
    cols += [f"{b} speed-up" for b in args.backends]
    cols += ["memcpy GB/s", f"{args.backends[0]}/memcpy"]
    out("| " + " | ".join(cols) + " |")
    out("|" + " --- |" * len(cols))
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
            finally:
                for link in links.values():
                    link.close()
        memcpy = flat.size / statistics.median(copies) / 1e9
        for m in sides:
            row = [f"{P} -> {D}", m, str(pairs), f"{sum(len(t) for _, _, t in tables[m]):,}",
                   f"{plan_us[m]:,.0f}"]
            row += [f"{gbs[m][b]:.2f}" for b in args.backends]
            row += [f"{gbs[m][b] / gbs['per-token'][b]:.1f}x" for b in args.backends]
            row += [f"{memcpy:.2f}", f"{gbs[m][args.backends[0]] / memcpy:.2f}x"]
            out("| " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdxfer bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pages", type=int, default=96, help="entries in every pool")
    parser.add_argument("--request", type=int, default=32, help="pages one request moves")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default="loopback,tcp")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    missing = [b for b in args.backends if b not in transport.available()]
    if missing:
        parser.error(f"backends {missing} not installed; installed: {transport.available()}")
    if args.heads % 8 or args.request > args.pages:
        parser.error("--heads must be a multiple of 8 (TP up to 8) and --request <= --pages")
    torch.set_num_threads(1)
    print(f"<!-- pdxfer bench tp: {platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; {args.layers} layers x k,v x {args.heads} heads x {args.head_dim} "
          f"bf16, {PAGE}-token pages, {args.request}-page request, median of {args.reps} -->")
    run(args, print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
