"""`pdxfer bench ...` runs tiny in the suite: tables with a legend, raw samples as JSON, plots.

Nothing here asserts a speed; it asserts what the numbers are OF (segments,
bytes, which methods and backends ran) and that every column is explained.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

from pdxfer import cli
from pdxfer.bench import report
from pdxfer.bench.report import Progress

TWO = "loopback,tcp"


def _table_and_legend(out: str) -> tuple[list[str], list[str]]:
    """Every column the table printed (over all its groups, in order) and the legend's names."""
    table, legend = out.split("columns:\n", 1)
    lines = table.splitlines()
    columns: list[str] = []
    for header, rule in zip(lines, lines[1:], strict=False):
        if header.startswith("| ") and rule.startswith("| ---"):
            columns += [c.strip() for c in header.strip("|").split("|") if c.strip() not in columns]
    return columns, [line.split(":", 1)[0].strip() for line in legend.splitlines() if line.startswith("  ")]


def test_bench_layouts_tiny_ships_three_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "layouts.json"
    assert cli.main(["bench", "layouts", "--tiny", "--reps", "1", "--backends", TWO, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    columns, legend = _table_and_legend(out)
    assert legend == columns
    data = json.loads(path.read_text())
    assert data["backends"] == ["loopback", "tcp"] and data["machine"]["cores"]
    rows = data["rows"]
    assert {(r["model"], r["backend"]) for r in rows} == {
        (m, b) for m in ("example", "llama-8b", "deepseek-v4") for b in ("loopback", "tcp")}
    for model in ("example", "llama-8b", "deepseek-v4"):
        mine = {r["method"]: r for r in rows if r["model"] == model and r["backend"] == "tcp"}
        assert mine["staging"]["segments"] == 1
        assert mine["layer-major"]["segments"] > mine["whole entries"]["segments"] >= 1
        assert mine["staging"]["copied"] == 2 * mine["staging"]["bytes"]
        assert mine["whole entries"]["copied"] == mine["layer-major"]["copied"] == 0
    # tiny: 2 layers x 6 fields, one entry -> 12 layer-major segments, 1 whole
    ds = {r["method"]: r["segments"] for r in rows if r["model"] == "deepseek-v4"}
    assert (ds["whole entries"], ds["layer-major"]) == (1, 12)
    samples = [s for s in data["samples"] if s["method"] != "memcpy"]
    assert len(samples) == 3 * 2 * 3 and all(len(s["seconds"]) == 1 for s in samples)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is the optional 'plot' extra and is not installed")
def test_bench_layouts_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "layouts.png"
    assert cli.main(["bench", "layouts", "--tiny", "--reps", "1", "--backends", "loopback",
                     "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "layouts", "--tiny", "--plot", "x.png"])
    assert exc.value.code == 2
    assert "pip install 'pdxfer[plot]'" in capsys.readouterr().err


def test_bench_transport_json_has_every_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    assert cli.main(["bench", "transport", "--total-mib", "4", "--reps", "2", "--backends", "loopback",
                     "--json", str(path)]) == 0
    columns, legend = _table_and_legend(capsys.readouterr().out)
    assert legend == columns
    data = json.loads(path.read_text())
    methods = {"memcpy", "memcpy/seg", "loopback"}
    assert {s["method"] for s in data["samples"]} == methods
    assert len(data["samples"]) == 6 * len(methods)
    assert all(len(s["seconds"]) == 2 for s in data["samples"])
    assert set(data["columns"]) == set(columns)


def test_progress_reports_rows_elapsed_and_eta_only_on_long_runs() -> None:
    quiet, loud = io.StringIO(), io.StringIO()
    short = Progress(3, "rows", stream=quiet)  # default: silent for the first few seconds
    long = Progress(3, "rows", stream=loud, after_s=0.0, every_s=0.0)
    for i in range(3):
        short.step(f"row {i}")
        long.step(f"row {i}")
    assert quiet.getvalue() == ""
    lines = loud.getvalue().splitlines()
    assert lines[0].startswith("[1/3 rows, ") and "s elapsed, ETA " in lines[0]
    assert lines[-1].startswith("[3/3 rows, ") and lines[-1].endswith("ETA 0 s] row 2")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bench_transport_raw_nixl_columns_and_two_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], processes: str) -> None:
    pytest.importorskip("nixl_cu12", reason="raw NIXL columns need the nixl extra")
    path = tmp_path / "t.json"
    assert cli.main(["bench", "transport", "--total-mib", "4", "--reps", "1", "--backends", "tcp,nixl",
                     "--processes", processes, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    columns, legend = _table_and_legend(out)
    assert legend == columns
    assert {"raw NIXL (tcp)", "raw NIXL (UCX default)", "nixl/raw NIXL (tcp)",
            "tcp/raw NIXL (UCX default)"} <= set(columns)
    data = json.loads(path.read_text())
    assert data["params"]["processes"] == int(processes)
    # every method ran every case once, each run crc-checked (a wrong byte aborts the bench)
    methods = {"memcpy", "memcpy/seg", "raw socket", "tcp", "tcp 1 stream", "nixl",
               "raw NIXL (tcp)", "raw NIXL (UCX default)"}
    assert {s["method"] for s in data["samples"]} == methods
    assert len(data["samples"]) == 6 * len(methods)


def test_bench_scaling_tiny_both_layouts_every_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    assert cli.main(["bench", "scaling", "--tiny", "--reps", "1", "--backends", "loopback",
                     "--json", str(path)]) == 0
    columns, legend = _table_and_legend(capsys.readouterr().out)
    assert legend == columns
    rows = json.loads(path.read_text())["rows"]
    # tiny: 1, 4, 16 pages and 64 KiB, 256 KiB entries, each in both layouts (bytes crc-checked)
    assert {(r["pool"], r["entries"], r["entry_bytes"]) for r in rows} == {
        ("kv pages", 1, 65536), ("kv pages", 4, 65536), ("kv pages", 16, 65536),
        ("state entry", 1, 65536), ("state entry", 1, 262144)}
    for r in rows:
        if r["layout"] == "layer-major":  # one row per field x layer x run: 16 per entry-major row
            twin = next(e for e in rows if e["layout"] == "entry-major" and e["pool"] == r["pool"]
                        and e["entries"] == r["entries"] and e["entry_bytes"] == r["entry_bytes"])
            assert r["segments"] == 16 * twin["segments"]
        assert r["bytes"] == r["entries"] * r["entry_bytes"] and len(r.keys()) > 5


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bench_chunked_reports_exposed_time_per_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     processes: str) -> None:
    path = tmp_path / "c.json"
    assert cli.main(["bench", "chunked", "--pages", "8", "--chunks", "4", "--compute-ms", "1",
                     "--reps", "1", "--backends", "tcp", "--processes", processes,
                     "--json", str(path)]) == 0
    columns, legend = _table_and_legend(capsys.readouterr().out)
    assert legend == columns
    data = json.loads(path.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"chunked", "after", "transfer only"}  # every request's entries crc-checked
    assert rows["chunked"]["chunks"] == 4 and rows["after"]["chunks"] == 1
    assert rows["chunked"]["compute_ms"] == rows["after"]["compute_ms"] == 4.0
    assert rows["transfer only"]["compute_ms"] == 0.0
    assert rows["chunked"]["hidden"] == pytest.approx(
        1 - rows["chunked"]["exposed_ms"] / rows["after"]["exposed_ms"])
    assert all(len(s["seconds"]) == 1 for s in data["samples"])


def test_bench_engine_two_processes_same_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "e.json"
    assert cli.main(["bench", "engine", "--requests", "6", "--batch", "3", "--backends", "tcp",
                     "--processes", "2", "--json", str(path)]) == 0
    columns, legend = _table_and_legend(capsys.readouterr().out)
    assert legend == columns and "engine req/s" in columns
    data = json.loads(path.read_text())
    assert data["params"]["processes"] == 2
    # the bench itself exits if a request's segments differ from the runs it names
    segs = {r["kv layout"]: r["segments"] for r in data["rows"]}
    assert segs == {"entry-major": 17, "layer-major": 257, "per-layer tensors": 257}
    assert all(r["engine_rps"] > 0 and r["bare_rps"] > 0 for r in data["rows"])


def test_benches_time_pieces_of_their_own_engine_only(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """While a bench times send(), nothing shared (a module function, a class method) is replaced.

    Checked at every send() of `bench engine` and `bench request-cost`: the
    functions the split columns time are the originals, and the data
    connection's class has its own `write` (a timer defined inside a
    function would show `<locals>` in its qualified name) — so every other
    engine in the process runs untimed, whatever the bench does.
    """
    import inspect

    from pdxfer import decode, expects, layout, pools, prefill

    def shared() -> dict[str, object]:
        return {"layout.plan_segments": layout.plan_segments, "Route.plan": pools.Route.plan,
                "decode.expect_message": decode.expect_message,
                "expects.expect_message": expects.expect_message}

    before = shared()
    replaced: set[str] = set()
    sends = 0
    send = prefill.PrefillEngine.send

    def checked_send(self, *args, **kwargs):
        nonlocal sends
        sends += 1
        replaced.update(k for k, v in shared().items() if v is not before[k])
        for session in self._sessions.values():
            conn = getattr(session.conn, "_target", session.conn)  # under a bench's own probe
            write = inspect.getattr_static(type(conn), "write", None)
            if write is not None and "<locals>" in write.__qualname__:
                replaced.add(f"{type(conn).__name__}.write")
        return send(self, *args, **kwargs)

    monkeypatch.setattr(prefill.PrefillEngine, "send", checked_send)
    assert cli.main(["bench", "engine", "--requests", "4", "--batch", "2", "--backends", "loopback"]) == 0
    assert cli.main(["bench", "request-cost", "--requests", "4", "--batch", "2", "--rounds", "1",
                     "--latency", "1", "--backends", "tcp"]) == 0
    capsys.readouterr()
    assert sends > 20
    assert not replaced, f"replaced process-wide while a bench ran: {sorted(replaced)}"


def test_bench_transport_table_fits_the_width_and_json_keeps_every_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    assert cli.main(["bench", "transport", "--tiny", "--backends", TWO, "--width", "80",
                     "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = out.split("columns:\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows and max(len(line) for line in rows) <= 80, max(rows, key=len)
    columns, legend = _table_and_legend(out)
    headers = [line for line in rows if line.startswith("| case |")]
    assert len(headers) > 1  # loopback and tcp's 10 columns do not fit 80 characters in one
    assert legend == columns and len(columns) == 10
    data = json.loads(path.read_text())
    assert set(data["columns"]) == set(columns)
    assert {"memcpy", "loopback", "raw socket", "tcp", "tcp 1 stream"} <= set(data["rows"][0])
    assert cli.main(["bench", "transport", "--tiny", "--backends", "loopback", "--width", "0"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines()
                if line.startswith("| case |")]) == 1


def test_bench_tp_has_json_legend_and_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(report, "PROGRESS_AFTER_S", 0.0)  # a tiny run is quick: show it anyway
    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    path = tmp_path / "tp.json"
    assert cli.main(["bench", "tp", "--tiny", "--backends", "loopback", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    columns, legend = _table_and_legend(captured.out)
    assert legend == columns
    assert columns == ["P -> D", "method", "pairs", "segments", "plan us", "loopback GB/s",
                       "loopback speed-up", "memcpy GB/s", "loopback/memcpy"]
    assert "[4/4 case x backend, " in captured.err
    data = json.loads(path.read_text())
    assert set(data["columns"]) == set(columns) and data["params"]["layers"] == 2
    assert len(data["rows"]) == 8 and all(r["segments"] > 0 for r in data["rows"])
    # every timed run kept: 4 cases x 2 methods x 1 backend, plus the memcpy per case
    assert len(data["samples"]) == 4 * 3 and all(len(s["seconds"]) == 1 for s in data["samples"])


def test_log_axis_only_where_one_series_dwarfs_the_others() -> None:
    matplotlib = pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        even, skewed = plt.subplots(1, 2)[1]
        report.log_if_dwarfed(even, [900, 1200, 2000])
        report.log_if_dwarfed(skewed, [50, 1200, 2000])  # nixl's requests/s beside loopback's
        assert (even.get_yscale(), skewed.get_yscale()) == ("linear", "log")
    finally:
        plt.close("all")


def test_plot_legend_sits_outside_every_panel() -> None:
    matplotlib = pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def draw(plt) -> None:
        _, axes = plt.subplots(1, 2)
        for ax in axes:
            ax.plot([1, 2, 3], [3, 1, 2], label="tcp")
            ax.bar([1, 2], [2, 3], label="loopback")

    try:
        fig = report.compose(plt, draw, "title", "note")
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes)
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == ["tcp", "loopback"]  # one entry each
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer))
    finally:
        plt.close("all")


def test_the_engine_never_imports_the_benches() -> None:
    """`pdxfer/bench/` measures the engine; no engine module may depend on it (the CLI names
    bench modules as strings and imports the one asked for)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "pdxfer"
    offenders = []
    for path in root.rglob("*.py"):
        if "bench" in path.relative_to(root).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from . import bench` names it as an alias
                base = f"{'.' * node.level}{node.module or ''}"
                names = [base] if node.module else [f"{base}{a.name}" for a in node.names]
            else:
                continue
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n.startswith(("pdxfer.bench", ".bench", "..bench"))]
    assert not offenders


def test_a_bench_leaves_torch_threads_as_it_found_them(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # any value but the benches' 1
    try:
        assert cli.main(["bench", "tp", "--tiny", "--backends", "loopback"]) == 0
        assert cli.main(["bench", "elastic", "--tiny"]) == 0
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
        capsys.readouterr()


def test_bench_peers_tiny_reports_throughput_memory_and_threads(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "peers.json"
    assert cli.main(["bench", "peers", "--tiny", "--requests", "8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| tcp | 2 | 4 | 8 |" in out and "threads/peer" in out
    data = json.loads(path.read_text())
    memory = [s for s in data["samples"] if s["kind"] == "memory"]
    points = [s for s in data["samples"] if s["kind"] == "throughput"]
    assert [(m["side"], m["peers"]) for m in memory] == [("prefill: out", 1), ("prefill: out", 2),
                                                          ("transport: in", 1), ("transport: in", 2)]
    assert [(p["peers"], p["inflight"]) for p in points] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(len(p["latency_us"]) == 8 and p["req_s"] > 0 for p in points)
    # the bench forces tcp's bounce path: its pool is what a GPU host would pin, 2 streams a peer
    assert [m["bounce"] for m in memory] == [k * (8 << 20) for k in (2, 4, 2, 4)]
    assert all(m["threads"] > m["base_threads"] for m in memory)


def test_bench_directory_names_a_bad_etcd_binary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "directory", "--tiny", "--etcd-binary", str(tmp_path / "no-etcd")])
    assert exc.value.code == 2
    assert "--etcd-binary: etcd binary" in capsys.readouterr().err
