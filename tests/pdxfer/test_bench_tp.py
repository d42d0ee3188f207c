"""`pdxfer bench tp` at a toy size: it runs, checks its bytes, and counts segments as claimed."""

from __future__ import annotations

import re

from pdxfer.bench import tp as bench_tp


def test_bench_tp_counts_one_segment_per_entry_per_pair(capsys) -> None:
    assert bench_tp.main(["--layers", "2", "--pages", "6", "--request", "3", "--reps", "1",
                          "--backends", "loopback"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d) -> (\d) \| (\S+) \| (\d+) \| ([\d,]+) \|", out, re.M)
    assert len(rows) == 2 * len(bench_tp.CASES), out
    for P, D, method, pairs, segments in rows:
        tokens_layers_fields = bench_tp.PAGE * 2 * 2
        per_pair = 3 if method == "shard-major" else 3 * tokens_layers_fields
        assert int(segments.replace(",", "")) == int(pairs) * per_pair, (P, D, method)
