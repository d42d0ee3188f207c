"""What one verbs work request costs to build in CPython, with real pyverbs objects.

The verbs backend builds one `SendWR` (plus one `SGE` per row) per WR in
Python, so this cost times WRs per request is its CPU floor per request. It
cannot post here (no RDMA device), so it measures what runs on the posting
thread before `ibv_post_send`: `verbs.build.write_wrs` (SGEs, SendWR,
`set_wr_rdma`) and `link` (`next_wr`), per WR, for 1 and 8 SGEs per WR.
With `--api soft` it measures the software fabric's objects instead.

    PYTHONPATH=.cache/pyverbs/usr/lib/python3/dist-packages \\
    LD_LIBRARY_PATH=.cache/pyverbs/usr/lib/x86_64-linux-gnu:.cache/pyverbs/lib/x86_64-linux-gnu \\
    python benchmarks/verbs_wr_cost.py            # `make pyverbs` fetches the prefix
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer.transport.verbs import build  # noqa: E402
from pdxfer.transport.verbs.api import load  # noqa: E402
from pdxfer.transport.verbs.sim import namespace as soft  # noqa: E402


def per_wr_us(api: object, wrs: int, sges: int, reps: int) -> tuple[float, float]:
    """Median microseconds per WR to build, and to link, `wrs` WRs of `sges` SGEs each."""
    rows = np.stack([np.arange(wrs * sges) * 8192, np.arange(wrs * sges) * 4096,
                     np.full(wrs * sges, 4096)], 1).astype(np.int64)
    starts = np.arange(wrs, dtype=np.int64) * sges
    builds, links = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = build.write_wrs(api, rows, starts, src_base=1 << 30, lkey=1, dst_base=1 << 31, rkey=2,
                              signal_every=64)
        t1 = time.perf_counter()
        build.link(out)
        t2 = time.perf_counter()
        builds.append((t1 - t0) / wrs)
        links.append((t2 - t1) / wrs)
    return statistics.median(builds) * 1e6, statistics.median(links) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", choices=("real", "soft"), default="real")
    parser.add_argument("--wrs", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="64 WRs, one run: a smoke run")
    args = parser.parse_args()
    if args.tiny:
        args.wrs, args.reps = 64, 1
    api = load() if args.api == "real" else soft()
    print(f"# {args.api} pyverbs objects, {args.wrs} WRs per run, median of {args.reps}")
    print("| SGEs/WR | build us/WR | link us/WR | us per SGE |")
    print("|---|---|---|---|")
    for sges in (1, 8):
        b, link_us = per_wr_us(api, args.wrs, sges, args.reps)
        print(f"| {sges} | {b:.2f} | {link_us:.2f} | {b / sges:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
