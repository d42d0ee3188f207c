"""Figures a person would rather read than the table (#34 item 7).

Every series of a figure has its own colour and marker (the transport
figure's dozen series shared colours on matplotlib's 10-colour cycle), one
label keeps one style across panels, and the panels of one figure share one
y scale (the layouts figure mixed linear and log panels). `report.compose`
enforces both for every bench; `report.figure_problems` is the check. Each
bench that draws is run here at `--tiny` with `--plot`, and the figure it
drew is checked before it is saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pdxfer import cli  # noqa: E402
from pdxfer.bench import report  # noqa: E402


def _busy(p) -> None:
    """Twelve series on two panels, one of them log: what the rules exist for."""
    _, axes = p.subplots(1, 2)
    for i in range(12):
        axes[0].plot([1, 2], [i + 1, i + 2], label=f"m{i}")
        axes[1].plot([1, 2], [i + 1, 1000 * (i + 2)], label=f"m{i}")
    axes[1].set_yscale("log")


def test_the_check_sees_shared_colours_and_mixed_scales() -> None:
    _busy(plt)
    try:
        problems = report.figure_problems(plt.gcf())
    finally:
        plt.close("all")
    assert "panels on different y scales: ['linear', 'log']" in problems
    assert "'m0', 'm10' share one style" in problems  # the default cycle wraps after 10


def test_compose_gives_each_series_its_own_style_and_one_scale() -> None:
    try:
        fig = report.compose(plt, _busy, "title")
        assert report.figure_problems(fig) == []
        assert {ax.get_yscale() for ax in fig.axes} == {"log"}
        markers = {line.get_marker() for line in fig.axes[0].get_lines()}
        assert len(markers) == 10  # colour and marker both vary
    finally:
        plt.close("all")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bench", ["transport", "engine", "layouts", "scaling", "peers"])
def test_every_drawn_figure_keeps_the_rules(bench: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[list[str]] = []
    compose = report.compose

    def checked(*args, **kwargs):
        fig = compose(*args, **kwargs)
        drawn.append(report.figure_problems(fig))
        return fig

    monkeypatch.setattr(report, "compose", checked)
    path = tmp_path / f"{bench}.png"
    assert cli.main(["bench", bench, "--tiny", "--width", "0", "--plot", str(path)]) == 0
    assert drawn and path.stat().st_size > 0
    assert drawn == [[]] * len(drawn), drawn
