"""`pdxfer bench request-cost` runs tiny in the suite: both tables, every column explained.

Nothing here asserts a speed (figures live in docs/benchmarks.md); it
asserts what the numbers are of: one row per backend in each table, per-call
samples kept for every timed send and expect, and a legend for every column.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdxfer import cli


def test_request_cost_prints_costs_and_rates_with_a_legend(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    assert cli.main(["bench", "request-cost", "--requests", "12", "--batch", "4", "--rounds", "1",
                     "--latency", "3", "--backends", "loopback,tcp", "--width", "0",
                     "--json", str(path)]) == 0
    out = capsys.readouterr().out
    headers = [[c.strip() for c in line.strip("|").split("|")]
               for line in out.splitlines() if line.startswith("| backend")]
    assert len(headers) == 2
    rows = [line for line in out.splitlines() if line.startswith("| loopback") or line.startswith("| tcp")]
    assert len(rows) == 4  # a cost row and a rate row per backend
    legend = {line.split(":", 1)[0].strip() for line in out.split("columns:\n", 1)[1].splitlines()
              if line.startswith("  ")}
    assert legend == set(headers[0]) | set(headers[1])
    data = json.loads(path.read_text())
    # Every timed call is kept: 12 sends and 12 expects per backend and round.
    assert [len(s["send_ns"]) for s in data["samples"]] == [12, 12]
    assert [len(s["expect_ns"]) for s in data["samples"]] == [12, 12]
    assert {r["backend"] for r in data["rows"]} == {"loopback", "tcp"}
    assert all(r["engine/bare"] > 0 for r in data["rows"] if "engine/bare" in r)
