"""`pdxfer bench elastic`: what moving a page/state boundary costs, and how much it moves.

Two tables.

Relocation throughput. One `layout.ElasticPools` of `--slots` slots (KV
pages of 16 KiB in 64 KiB slots, so a page move is a strided copy; states
of 64 KiB, a slot each), its bytes random. Each case moves the boundary by
a quarter of the slots with a share of the vacated entries in use and the
free entries they go to either contiguous (one run) or scattered (every
other one used: one run per entry): `plan_resize` timed alone, then
`relocate`. The baseline is a `copy_` of the same number of bytes between
two contiguous buffers on the same device, timed in the same run, so the
ratio says what planning, runs and strides cost over the bytes themselves.
Every relocation is checked against the source bytes (crc32 of each moved
entry before and after), so a wrong move stops the bench.

Entries moved per resize. A simulated serving pool (`--sim-slots` slots,
requests of 1 state + 2..8 pages arriving and finishing at random, about
60% or 85% of the slots in use) whose boundary moves by `--step` slots, the state
pool growing and shrinking in turn; between moves, requests churn. What a
move relocates depends on where the allocator put the entries, so three
allocators: "far" hands out pages lowest-first and states highest-first
(away from the boundary, what a serving allocator would do), "random", and
"near" (nearest the boundary first: the worst case, which the demo uses).

Times are medians of `--reps`. `--quick` shrinks everything to a short run,
`--tiny` to the smoke run the docs test makes.
CPU copies run on `--threads` torch threads (1 by default: on a loaded
machine torch's parallel copy of 1 MiB waits for a busy core, ~13 ms
against 0.03 ms on one thread, measured here at load 6).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from typing import Any

import numpy as np
import torch

from pdxfer import layout

from ..cliargs import bounded_int, device_name
from . import report as br

KiB, MiB = 1 << 10, 1 << 20
TARGETS = (0.6, 0.85)  # shares of the simulated pool's slots in use
PAGE = [layout.EntryField("kv", 4, (2048,), torch.float16)]  # 16 KiB
STATE = [layout.EntryField("state", 4, (8192,), torch.float16)]  # 64 KiB

COLUMNS = {
    "case": "which pool shrinks, and how the moved entries and their destinations lie",
    "moved": "entries relocated by the move",
    "runs": "copy runs (per plane): stretches contiguous on both sides",
    "MiB": "bytes relocated",
    "plan us": "plan_resize (median)",
    "relocate ms": "relocate: the copies and the boundary move (median)",
    "GB/s": "bytes relocated / relocate time",
    "memcpy GB/s": "one copy_ of the same bytes between two contiguous buffers, same device",
    "ratio": "relocation GB/s / memcpy GB/s",
}
SIM_COLUMNS = {
    "allocator": "where the simulated allocator puts new entries (see the module docstring)",
    "target": "share of the slots the churn keeps in use",
    "grow moved": "pages relocated per move that grows the state pool (mean)",
    "grow runs": "copy runs per such move (mean)",
    "shrink moved": "states relocated per move that shrinks the state pool (mean)",
    "shrink runs": "copy runs per such move (mean)",
    "in use": "share of the slots in use when the boundary moved (mean)",
    "refused": "moves refused: the shrinking pool had too few free entries for its movers",
}


def _timed(fn: Any, device: torch.device, reps: int) -> list[float]:
    # Both timed operations copy on the current stream: waiting for it is waiting for them.
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    out = []
    for _ in range(reps):
        if stream is not None:
            stream.synchronize()
        t = time.perf_counter()
        fn()
        if stream is not None:
            stream.synchronize()
        out.append(time.perf_counter() - t)
    return out


def _case(name: str, slots: int, shrink: str, scattered: bool) -> tuple[str, int, int, np.ndarray]:
    """(case, boundary before, after, used entries of the shrinking pool)."""
    quarter = slots // 4
    if shrink == "page":  # the state pool grows by a quarter: pages in [B - q, B) leave
        old, new = slots // 2 + quarter, slots // 2
        vacated, kept = np.arange(new, old), np.arange(0, new)
    else:  # the page pool grows by a quarter: states in [B, B + q) leave
        old, new = slots // 4, slots // 2
        vacated, kept = np.arange(old, new), np.arange(new, slots)
    if scattered:  # every other entry in use on both sides: one run per moved entry
        movers, staying = vacated[::2], kept[1::2]
    elif shrink == "page":  # the free pages the movers take (the lowest) form one stretch
        movers, staying = vacated, kept[: kept.size - vacated.size]
    else:  # ... and so do the free states (the highest)
        movers, staying = vacated, kept[vacated.size:]
    return name, old, new, np.concatenate([movers, staying])


def _crc(pools: layout.ElasticPools, pool: str, idx: np.ndarray) -> list[int]:
    plane, w, n = pools.planes[0], pools.plane_bytes[0], pools.entry_bytes(pool)[0]
    host = plane.cpu().numpy() if plane.is_cuda else plane.numpy()
    return [zlib.crc32(host[i * w: i * w + n]) for i in idx.tolist()]


def relocation_rows(slots: int, reps: int, device: torch.device, report: br.Report,
                    progress: br.Progress | None = None) -> list[dict]:
    """The throughput table: one row per case, checked, with its memcpy baseline."""
    size = layout.ElasticPools.allocation_bytes(PAGE, STATE, slots)
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    cases = [_case(f"{pool} shrinks, {how}", slots, pool, how == "scattered")
             for pool in ("page", "state") for how in ("contiguous", "scattered")]
    rows = []
    for name, old, new, used in cases:
        pools = layout.ElasticPools(PAGE, STATE, slots, old, buf=buf)
        plan = layout.plan_resize(pools, new, used)
        want = _crc(pools, plan.shrinking, plan.moves.old)
        layout.relocate(pools, plan)  # checked, and the warm-up (first touch of every page)
        if _crc(pools, plan.shrinking, plan.moves.new) != want:
            raise RuntimeError(f"{name}: relocated entries differ from their sources")
        src = torch.ones(plan.nbytes, dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        dst.copy_(src)
        plan_s, reloc_s, memcpy_s = [], [], []
        for _ in range(reps):  # the two take turns, so both see the same load
            # The same move again from the old boundary (the bytes need not be restored).
            pools = layout.ElasticPools(PAGE, STATE, slots, old, buf=buf)
            t = time.perf_counter()
            plan = layout.plan_resize(pools, new, used)
            plan_s.append(time.perf_counter() - t)
            reloc_s += _timed(lambda p=pools, q=plan: layout.relocate(p, q), device, 1)
            memcpy_s += _timed(lambda d=dst, s=src: d.copy_(s), device, 1)
        report.sample(case=name, plan_s=plan_s, relocate_s=reloc_s, memcpy_s=memcpy_s,
                      moved=plan.entries, nbytes=plan.nbytes, runs=int(plan.runs.shape[0]))
        gbs = plan.nbytes / statistics.median(reloc_s) / 1e9
        mgbs = plan.nbytes / statistics.median(memcpy_s) / 1e9
        rows.append({"case": name, "moved": plan.entries, "runs": int(plan.runs.shape[0]),
                     "MiB": plan.nbytes / MiB, "plan us": statistics.median(plan_s) * 1e6,
                     "relocate ms": statistics.median(reloc_s) * 1e3, "GB/s": gbs,
                     "memcpy GB/s": mgbs, "ratio": gbs / mgbs})
        if progress is not None:
            progress.step(name)
    return rows


def _take(used: np.ndarray, lo: int, hi: int, count: int, where: str, page: bool,
          rng: np.random.Generator) -> np.ndarray | None:
    free = np.flatnonzero(~used[lo:hi]) + lo
    if free.size < count:
        return None
    if where == "random":
        return rng.choice(free, count, replace=False)
    low_first = page == (where == "far")  # far: pages low, states high; near: the opposite
    return free[:count] if low_first else free[free.size - count:]


def simulate(where: str, target: float, slots: int, step: int, moves: int, seed: int) -> dict:
    """Mean entries and runs per move under churn, for one allocator policy."""
    rng = np.random.default_rng(seed)
    pools = layout.ElasticPools([layout.EntryField("p", 1, (64,), torch.uint8)],
                                [layout.EntryField("s", 1, (64,), torch.uint8)], slots, slots * 3 // 4)
    used = np.zeros(slots, dtype=bool)
    live: list[tuple[np.ndarray, np.ndarray]] = []
    stats: dict[str, list] = {"page": [], "state": [], "use": []}
    refused = 0
    for k in range(moves):
        for _ in range(slots // 8):  # churn: requests finish and arrive, about `target` in use
            if live and (used.mean() > target or rng.random() < 0.25):
                pages, state = live.pop(int(rng.integers(len(live))))
                used[pages] = used[state] = False
                continue
            b = pools.boundary
            pages = _take(used, 0, b, int(rng.integers(2, 9)), where, True, rng)
            if pages is None:
                continue
            used[pages] = True
            state = _take(used, b, slots, 1, where, False, rng)
            if state is None:
                used[pages] = False
                continue
            used[state] = True
            live.append((pages, state))
        grow = k % 2 == 0
        old = pools.boundary
        new = old - step if grow else old + step
        lo, hi = (0, old) if grow else (old, slots)
        try:
            plan = layout.plan_resize(pools, new, np.flatnonzero(used[lo:hi]) + lo)
        except layout.LayoutError:
            refused += 1  # too full to move now: a scheduler would retry later
            continue
        stats["use"].append(float(used.mean()))
        moved = layout.relocate(pools, plan)
        stats[plan.shrinking].append((plan.entries, int(plan.runs.shape[0])))
        used[moved.old] = False
        used[moved.new] = True
        live = [(moved.remap(p), moved.remap(s)) for p, s in live]

    def mean(pairs: list, i: int) -> float:
        return statistics.fmean(p[i] for p in pairs) if pairs else float("nan")

    return {"allocator": where, "target": target, "grow moved": mean(stats["page"], 0),
            "grow runs": mean(stats["page"], 1), "shrink moved": mean(stats["state"], 0),
            "shrink runs": mean(stats["state"], 1),
            "in use": statistics.fmean(stats["use"]) if stats["use"] else float("nan"),
            "refused": refused}


def _fmt(row: dict) -> dict[str, str]:
    out = {}
    for k, v in row.items():
        if isinstance(v, float):
            out[k] = f"{v:.0f}" if k == "plan us" else f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3f}"
        else:
            out[k] = str(v)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench elastic`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench elastic", description=__doc__.split("\n")[0])
    # Defaults are (full run, --quick, --tiny); an option given on the line wins over the first
    # two, --tiny over everything (the docs test appends it to whatever the line says).
    sizes = {"slots": (4096, 256, 64), "reps": (7, 3, 1), "sim_slots": (2048, 256, 64),
             "step": (128, 16, 8), "moves": (200, 20, 4)}
    parser.add_argument("--slots", type=bounded_int(8, 1 << 16),
                        help="slots of the allocation (64 KiB each) for the throughput table (4096)")
    parser.add_argument("--reps", type=bounded_int(1, 10_000), help="timed moves per case, median (7)")
    parser.add_argument("--sim-slots", type=bounded_int(64, 1 << 20), help="slots of the simulated pool (2048)")
    parser.add_argument("--step", type=bounded_int(1, 1 << 20), help="slots a simulated move shifts (128)")
    parser.add_argument("--moves", type=bounded_int(2, 1 << 20), help="simulated moves per allocator (200)")
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=bounded_int(1, 1024), default=1,
                        help="torch intra-op threads for CPU copies (1: a parallel copy on a "
                        "shared machine waits for a busy core, for both columns alike)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a short run")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes: a smoke run in a second")
    br.add_output_args(parser, plot=False)
    args = parser.parse_args(argv)
    br.check_outputs(parser, args)
    for name, (full, quick, tiny) in sizes.items():
        if args.tiny:
            setattr(args, name, tiny)
        elif getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    with br.torch_threads(args.threads):
        return _run(args, device)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    """Both tables, on `device`, with the sizes `main` settled."""
    report = br.Report("elastic", [], vars(args) | {"device": str(device), "json": None})
    width = br.terminal_width(args.width)
    progress = br.Progress(4 + len(TARGETS) * 3, "cases")
    print(f"# pdxfer bench elastic: {args.slots} slots of 64 KiB on {device}, median of {args.reps}, "
          f"{args.threads} torch thread(s)")
    print(br.machine_line())
    rows = relocation_rows(args.slots, args.reps, device, report, progress)
    show = br.markdown(list(COLUMNS), print, width)
    for row in rows:
        show(_fmt(row))
    show.close()
    br.print_legend(COLUMNS, list(COLUMNS))
    print(f"\n# simulated: {args.sim_slots} slots, moves of {args.step} slots, {args.moves} "
          "moves per allocator, requests of 1 state + 2..8 pages")
    sim = []
    for t in TARGETS:
        for w in ("far", "random", "near"):
            sim.append(simulate(w, t, args.sim_slots, args.step, args.moves, seed=7))
            progress.step(f"simulated {w} at {t}")
    show = br.markdown(list(SIM_COLUMNS), print, width, keys=2)
    for row in sim:
        show(_fmt(row))
    show.close()
    report.finish(SIM_COLUMNS, list(SIM_COLUMNS), rows + sim)
    report.write(args.json, COLUMNS | SIM_COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
