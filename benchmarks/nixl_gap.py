"""Where our nixl backend loses to raw NIXL on UCX tcp: NIXL's cost or our UCX configuration?

Three ways to move the same table between two buffers in one process, taking
turns, median of `--reps` after a warm-up:

- `ours`: a `write` between two nixl engines (checks, planning, acks);
- `raw NIXL (tcp)`: NIXL used directly, as in `pdxfer bench transport`'s column
  (prepared lists, a reposted request, NIXL's progress thread, UCX `TLS=tcp`
  on every interface);
- `raw NIXL, our UCX config`: the same prepared request on agents built by
  `transport.nixl.agent.make_agent`, as our backend builds them (UCX `TLS=tcp` on the one
  interface of the engine's host, peer error handling, no progress thread).

    .venv/bin/python benchmarks/nixl_gap.py --total-mib 64 --segment-kib 4096 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer import transport  # noqa: E402
from pdxfer.bench.peer import LocalPeer  # noqa: E402
from pdxfer.bench.rawnixl import RawNixlPair  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--segment-kib", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="independent set-ups, one line each")
    parser.add_argument("--tiny", action="store_true", help="4 MiB, one run, one round: a smoke run")
    args = parser.parse_args()
    if args.tiny:
        args.total_mib, args.reps, args.rounds = 4, 1, 1
    total, seg = args.total_mib << 20, args.segment_kib << 10
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    n = total // seg
    table = np.stack([np.arange(n) * seg, rng.permutation(n) * seg, np.full(n, seg)], 1).astype(np.int64)
    print(f"{n} x {seg >> 10} KiB shuffled, {total >> 20} MiB, median of {args.reps}, GB/s")
    for _ in range(args.rounds):
        peers = [LocalPeer(total) for _ in range(3)]
        tx = transport.create("nixl")
        try:
            far = peers[0].call("engine", backend="nixl", options={})
            region, conn = tx.register(torch.from_numpy(src)), tx.connect(far["address"])
            raw = RawNixlPair(src, peers[1], "tcp")
            mine = RawNixlPair(src, peers[2], "tcp", tx.device)
            for pair in (raw, mine):
                pair.prepare(table)
            desc = far["descriptor"]

            def ours(conn=conn, region=region, desc=desc) -> None:
                conn.write(region, desc, table).wait(60)

            runs = {"ours": ours,
                    "raw NIXL (tcp)": raw.move, "raw NIXL, our UCX config": mine.move}
            times: dict[str, list[float]] = {k: [] for k in runs}
            for i in range(args.reps + 1):
                for name, run in runs.items():
                    t = time.perf_counter()
                    run()
                    if i:
                        times[name].append(time.perf_counter() - t)
            gbs = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
            print("  ".join(f"{k} {v:.2f}" for k, v in gbs.items()),
                  f"| ours/raw {gbs['ours'] / gbs['raw NIXL (tcp)']:.2f}x"
                  f"  ours/raw-our-config {gbs['ours'] / gbs['raw NIXL, our UCX config']:.2f}x", flush=True)
            raw.close()
            mine.close()
        finally:
            tx.close()
            for p in peers:
                p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
