"""Figures a person would rather read than the table (#34 item 7).

Every series of a figure has its own colour and marker (the transport
figure's dozen series shared colours on matplotlib's 10-colour cycle), one
label keeps one style across panels, and the panels of one figure share one
y scale (the layouts figure mixed linear and log panels). `report.compose`
enforces both for every bench; `report.figure_problems` is the check. Each
bench that draws is run here at `--tiny` with `--plot`, and the figure it
drew is checked before it is saved. Ticks read in the units a person uses
(4 KiB, 250 µs, 16), never 2^6 or 10^3, and never against an offset in the
corner (a tiny peers run's RSS of 1521.0 and 1521.3 MiB read "+1.521e3").

The committed figures in `docs/img/` are checked too: each names the bench
that drew it and a digest of the code it depends on, which must be today's
(`layouts.png` was once drawn by an older bench and contradicted the table
beside it), and docs/benchmarks.md must give the command that draws it.
"""

from __future__ import annotations

import re
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
    assert any(p.startswith("y ticks of '' in powers") for p in problems), problems  # 10^3


def test_compose_gives_each_series_its_own_style_and_one_scale() -> None:
    try:
        fig = report.compose(plt, _busy, "title")
        assert report.figure_problems(fig) == []
        assert {ax.get_yscale() for ax in fig.axes} == {"log"}
        markers = {line.get_marker() for line in fig.axes[0].get_lines()}
        assert len(markers) == 10  # colour and marker both vary
    finally:
        plt.close("all")


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """`report.figure_problems` of every figure composed during the test, in order."""
    problems: list[list[str]] = []
    compose = report.compose

    def checked(*args, **kwargs):
        fig = compose(*args, **kwargs)
        problems.append(report.figure_problems(fig))
        return fig

    monkeypatch.setattr(report, "compose", checked)
    return problems


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bench", ["transport", "engine", "layouts", "scaling", "peers"])
def test_every_drawn_figure_keeps_the_rules(bench: str, tmp_path: Path, drawn: list[list[str]]) -> None:
    path = tmp_path / f"{bench}.png"
    assert cli.main(["bench", bench, "--tiny", "--width", "0", "--plot", str(path)]) == 0
    assert drawn and path.stat().st_size > 0
    assert drawn == [[]] * len(drawn), drawn


ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
COMMITTED = sorted(IMG.glob("*.png"))


def test_time_ticks_read_in_units() -> None:
    assert [report.human_seconds(s) for s in (2, 0.012, 0.00025, 0)] == ["2 s", "12 ms", "250 µs", "0"]
    try:
        # labels first, then log (peers' order): matplotlib's set_yscale alone drops them
        fig = report.compose(plt, lambda p: (p.plot([1, 2], [1e-5, 0.2], label="a"),
                                             report.time_axis(p.gca()),
                                             report.log_if_dwarfed(p.gca(), [1e-5, 0.2])), "t")
        assert report.figure_problems(fig) == []
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert "10 µs" in labels and "100 ms" in labels, labels
    finally:
        plt.close("all")



def _close_together(p) -> None:
    """Values a linear axis labels against an offset or a power left to matplotlib."""
    _, axes = p.subplots(1, 2)
    axes[0].plot([1, 2], [1521.0, 1521.3], label="rss")  # two RSS points in MiB
    axes[1].plot([1, 2], [1e-6, 3e-6], label="tiny")


def test_the_check_sees_an_offset_in_the_corner() -> None:
    _close_together(plt)
    try:
        problems = report.figure_problems(plt.gcf())
    finally:
        plt.close("all")
    assert "y ticks of '' read against an offset in the corner: '+1.521e3'" in problems, problems
    assert "y ticks of '' read against an offset in the corner: '1e\u22126'" in problems, problems


def test_linear_ticks_read_as_the_values_themselves() -> None:
    """The flaky peers figure: a tiny run's 1- and 2-peer RSS 0.3 MiB apart (+1.521e3)."""
    try:
        fig = report.compose(plt, _close_together, "t")
        assert report.figure_problems(fig) == []
        rss, tiny = ([t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes)
        assert "1521.00" in rss and "1521.30" in rss, rss
        assert "0.00000100" in tiny, tiny
    finally:
        plt.close("all")


def test_the_peers_figure_reads_close_rss_values(tmp_path: Path, drawn: list[list[str]]) -> None:
    """Every panel of `bench peers` stays linear here, RSS and threads a fraction apart."""
    from pdxfer.bench import peers

    results = [{"backend": "tcp", "peers": n, "inflight": 1, "req_s": 500.0 + n, "p99_us": 900.0 + n}
               for n in (1, 2)]
    memory = [{"backend": "tcp", "side": side, "peers": n, "rss": (1521 + 0.3 * n) * 2**20,
               "threads": 1000 + 0.01 * n, "bounce": 16 * 2**20 + n}
              for side in ("prefill: out", "transport: in") for n in (1, 2)]
    peers.plot(results, memory, tmp_path / "peers.png", "note")
    assert drawn == [[]], drawn


def test_the_source_digest_ignores_prose_and_sees_code(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "bench.py"
    monkeypatch.setattr(report, "figure_sources", lambda module: [src])
    code = '"""Module."""\n\ndef f():\n    """Doc."""\n    return 1  # one\n'
    src.write_text(code)
    before = report.source_digest("bench")
    src.write_text(code.replace("Doc.", "Longer\n    doc.").replace("\ndef", "\n# note\n\ndef"))
    assert report.source_digest("bench") == before
    src.write_text(code.replace("return 1", "return 2"))
    assert report.source_digest("bench") != before


def test_a_figure_depends_on_the_bench_modules_it_uses() -> None:
    names = {p.name for p in report.figure_sources("pdxfer.bench.peers")}
    # imported (report, peer), imported inside a function (procstat), a child's module (fleet)
    assert {"peers.py", "report.py", "peer.py", "procstat.py", "fleet.py"} <= names, names
    assert "layout_example.py" in {p.name for p in report.figure_sources("pdxfer.bench.layouts")}


def test_a_saved_figure_records_its_bench_and_code(tmp_path: Path) -> None:
    path = tmp_path / "f.png"
    report.figure(path, lambda p: p.plot([1, 2], [3, 4], label="a"), "t")
    text = report.png_text(path)
    assert text[report.BENCH_KEY] == __name__
    assert text[report.SOURCE_KEY] == report.source_digest(__name__)


def test_docs_img_holds_figures() -> None:
    assert COMMITTED, f"no figure in {IMG}"  # the next test would pass over nothing


@pytest.mark.parametrize("png", COMMITTED, ids=lambda p: p.name)
def test_each_committed_figure_is_drawn_by_todays_bench(png: Path) -> None:
    """A committed figure is older than nothing it depends on, and the docs say what draws it."""
    text = report.png_text(png)
    where = png.relative_to(ROOT)
    bench = text.get(report.BENCH_KEY)
    assert bench, f"{where} does not say which bench drew it: draw it with `pdxfer bench ... --plot {where}`"
    short = bench.rsplit(".", 1)[-1]
    command = re.search(rf"pdxfer bench {short}\b[^`\n]*--plot {re.escape(str(where))}", BENCHMARKS.read_text())
    assert command, f"docs/benchmarks.md gives no `pdxfer bench {short} ... --plot {where}`"
    changed = ", ".join(p.name for p in report.figure_sources(bench))
    assert text.get(report.SOURCE_KEY) == report.source_digest(bench), (
        f"{where} was drawn by other code than today's {bench} (one of {changed} changed since): "
        f"redraw it with `{command[0]}` and put the table of the same run beside it")
