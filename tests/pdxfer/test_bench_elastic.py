"""`pdxfer bench elastic` runs tiny in the suite: both tables, every column explained, raw samples.

Nothing here asserts a speed; it asserts what the figures are of: the moves
the cases describe (one run when contiguous, one per entry when scattered),
and that a serving allocator placing entries away from the boundary moves
fewer than one packing them against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdxfer import cli


def test_bench_elastic_quick_prints_both_tables_with_their_legends(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "elastic.json"
    assert cli.main(["bench", "elastic", "--quick", "--reps", "1", "--moves", "6", "--width", "0",
                     "--json", str(path)]) == 0
    out = capsys.readouterr().out
    tables = [line for line in out.splitlines() if line.startswith("| ")]
    headers = [[c.strip() for c in t.strip("|").split("|")] for t in tables if t.startswith("| case")
               or t.startswith("| allocator")]
    assert len(headers) == 2
    legends = out.split("columns:\n")[1:]
    for header, legend in zip(headers, legends, strict=True):
        named = [line.split(":", 1)[0].strip() for line in legend.splitlines() if line.startswith("  ")]
        assert named[:len(header)] == header
    data = json.loads(path.read_text())
    runs = {r["case"]: (r["moved"], r["runs"]) for r in data["rows"] if "case" in r}
    assert runs == {"page shrinks, contiguous": (64, 1), "page shrinks, scattered": (32, 32),
                    "state shrinks, contiguous": (64, 1), "state shrinks, scattered": (32, 32)}
    sim = {r["allocator"]: r for r in data["rows"] if r.get("target") == 0.6}
    assert sim["far"]["grow moved"] <= sim["near"]["grow moved"]
    assert sim["near"]["grow moved"] > 0
    assert len(data["samples"]) == 4 and all(len(s["relocate_s"]) == 1 for s in data["samples"])
