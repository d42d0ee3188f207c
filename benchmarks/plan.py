"""How long segment planning takes per call, for 100,000 entries.

Planning runs once per request on the sender's critical path, so it must stay
far below the transfer it plans: the target is well under 50 ms for 100,000
entries. Measured here rather than in a timed test (a shared CI machine makes
timed tests flaky). Arenas live on the `meta` device: planning reads only the
layout, so no memory is allocated.

Each case prints the median ms per `plan_segments` call and the rows it
produced. Two index patterns: `scattered` (a random permutation on both sides:
nothing merges, the worst case) and `runs` (requests of 16 consecutive
entries placed at random: the usual case). As a ratio inside one run, the
entry-major case is also planned by a plain Python loop per entry.

    python benchmarks/plan.py [--entries N] [--repeat R] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdxfer.layout import (  # noqa: E402
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    PageMajorMHAArena,
    plan_segments,
)

META = torch.device("meta")


def compressor_fields() -> list[EntryField]:
    """Six DeepSeek-V4-style state fields, one left out of checkpoints."""
    return [
        EntryField(f"{flavor}_{kind}", 4, (8, 128), torch.float32,
                   fill=float("-inf") if kind == "score" else 0.0,
                   in_checkpoint=not (flavor == "hca" and kind == "kv"))
        for flavor in ("csa", "hca", "idx")
        for kind in ("kv", "score")
    ]


def kv_fields(layers: int) -> list[EntryField]:
    shape = (16, 8, 128)
    return [EntryField("k", layers, shape, torch.bfloat16), EntryField("v", layers, shape, torch.bfloat16)]


def index_pairs(n: int, pattern: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "scattered":
        return rng.permutation(n).astype(np.int64), rng.permutation(n).astype(np.int64)
    run = 16
    blocks = n // run
    src = (rng.permutation(blocks)[:, None] * run + np.arange(run)).ravel()
    dst = (rng.permutation(blocks)[:, None] * run + np.arange(run)).ravel()
    return src.astype(np.int64), dst.astype(np.int64)


def time_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def python_loop_plan(arena: EntryMajorArena, src: np.ndarray, dst: np.ndarray) -> list:
    """The per-entry Python loop `plan_segments` replaces (sorted, merged as it goes)."""
    stride, nbytes = arena.slot_stride, arena.entry_bytes
    rows: list[list[int]] = []
    for s, d in sorted(zip(src.tolist(), dst.tolist(), strict=True)):
        so, do = s * stride, d * stride
        if rows and rows[-1][0] + rows[-1][2] == so and rows[-1][1] + rows[-1][2] == do:
            rows[-1][2] += nbytes
        else:
            rows.append([so, do, nbytes])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4, help="layers of the layer-major KV case")
    parser.add_argument("--quick", action="store_true", help="10,000 entries, 3 repeats")
    parser.add_argument("--tiny", action="store_true", help="1,000 entries, 1 repeat: a smoke run")
    args = parser.parse_args(argv)
    n, repeat = ((1_000, 1) if args.tiny else (10_000, 3) if args.quick
                 else (args.entries, args.repeat))
    rng = np.random.default_rng(0)

    state = EntryMajorArena(compressor_fields(), n, META)
    kv_layer = LayerMajorArena(kv_fields(args.layers), n, META)
    kv_pages = PageMajorMHAArena(args.layers, 8, 128, 128, torch.bfloat16, 16, n, META)
    cases = [
        ("entry-major", state, {}),
        ("checkpoint", state, {"checkpoint": True}),
        (f"layer-major ({2 * args.layers} field-layers)", kv_layer, {}),
        ("page-major", kv_pages, {}),
    ]
    print(f"plan_segments over {n} entries, median of {repeat} calls")
    print(f"{'case':<32}{'pattern':<11}{'ms/call':>9}{'rows':>10}")
    for pattern in ("scattered", "runs"):
        src, dst = index_pairs(n, pattern, rng)
        for name, arena, kw in cases:
            ms = time_ms(partial(plan_segments, arena, src, dst, **kw), repeat)
            rows = sum(t.shape[0] for t in plan_segments(arena, src, dst, **kw))
            print(f"{name:<32}{pattern:<11}{ms:>9.2f}{rows:>10}")
        loop_ms = time_ms(partial(python_loop_plan, state, src, dst), max(1, repeat // 4))
        ours = time_ms(partial(plan_segments, state, src, dst), repeat)
        print(
            f"{'python loop per entry':<32}{pattern:<11}{loop_ms:>9.2f}"
            f"{len(python_loop_plan(state, src, dst)):>10}   ({loop_ms / ours:.0f}x plan_segments)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
