"""How long a verbs write holds its link's lock, and how long it plans without it (verbs-sim).

A write's WRs cost ~5-15 us each to build in Python (`verbs_wr_cost.py`). Built under the
link's lock, they held up the progress thread's completions on that link and every other
writer to the same peer for the whole build; since #20 `VerbsLink.plan` builds them on the
caller's thread with no lock held, and `submit` (under the lock) only queues and posts. This
times both per write, on a table of scattered 4 KiB rows (one WR per row).

    .venv/bin/python benchmarks/verbs_lock_hold.py [--rows 4096] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer import transport  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    n = args.rows
    with transport.create("verbs-sim") as tx, transport.create("verbs-sim") as rx:
        src = tx.register(torch.ones(n * 8192, dtype=torch.uint8))
        dst = rx.register(torch.zeros(n * 8192, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        rows = np.stack([np.arange(n) * 8192, np.arange(n) * 8192, np.full(n, 4096)], 1).astype(np.int64)
        planned, held = [], []
        plan, submit = conn.plan, conn.submit

        def timed_plan(*a: object) -> object:
            t0 = time.perf_counter()
            out = plan(*a)
            planned.append(time.perf_counter() - t0)
            return out

        def timed_submit(post: object) -> None:
            t0 = time.perf_counter()
            submit(post)
            held.append(time.perf_counter() - t0)

        conn.plan, conn.submit = timed_plan, timed_submit
        for _ in range(args.reps):
            conn.write(src, dst.descriptor(), rows).wait(120)
    print(f"{n} WRs per write, median of {args.reps}, load average {os.getloadavg()[0]:.1f}: "
          f"plan (no lock) {statistics.median(planned) * 1e3:.2f} ms, "
          f"submit (link lock held) {statistics.median(held) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
