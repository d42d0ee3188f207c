"""`pdxfer bench layerwise` at --tiny: its rows, its descriptor counts and its figure (#33)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdxfer import cli
from pdxfer.bench import layerwise, report


def test_groups_cover_the_layers_in_order() -> None:
    assert layerwise.bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layerwise.bounds(32, 32)[-1] == (31, 32)
    got = layerwise.bounds(5, 2)
    assert got[0][0] == 0 and got[-1][1] == 5 and all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))


@pytest.mark.timeout(600)
def test_tiny_run_reports_descriptors_entries_x_groups_and_draws_a_clean_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    drawn: list[list[str]] = []
    compose = report.compose

    def checked(*args, **kwargs):
        fig = compose(*args, **kwargs)
        drawn.append(report.figure_problems(fig))
        return fig

    monkeypatch.setattr(report, "compose", checked)
    out, png = tmp_path / "lw.json", tmp_path / "lw.png"
    assert cli.main(["bench", "layerwise", "--tiny", "--backends", "loopback", "--width", "0",
                     "--json", str(out), "--plot", str(png)]) == 0
    assert drawn == [[]] and png.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"transfer only", "whole", "4 groups"}
    for r in rows:
        pages = r["tokens"] // layerwise.PAGE
        if r["groups"] >= 2:  # one range per page per group: layer ranges never coalesce
            assert r["descriptors"] == r["entries_x_groups"] == pages * r["groups"]
            whole = next(w for w in rows if w["tokens"] == r["tokens"] and w["mode"] == "whole")
            assert r["hidden"] == pytest.approx(1 - r["added_ms"] / whole["added_ms"])
        else:
            assert 0 < r["descriptors"] <= pages  # whole pages: runs may merge
        assert r["total_ms"] >= r["exposed_ms"] >= 0
        assert r["added_ms"] == pytest.approx(r["total_ms"] - r["compute_ms"])
