"""What every `pdxfer bench ...` shares: progress, raw samples, legend, plots.

A benchmark's printed table is a summary (medians, ratios); this module keeps
the rest of the evidence. `Report` holds every timed sample with the case it
belongs to, the machine and the backends used, and writes them as JSON
(`--json PATH`) so a reader can recompute any figure or plot it differently.
`Progress` tells a person waiting on a long run how far it is (rows done,
elapsed, ETA) on stderr, so stdout stays the table. `print_legend` explains
every column the table printed, from the same dict the bench used to pick
its columns, so a column cannot appear without its meaning. `Table` prints
the markdown table; one wider than `--width` is cut into several that share
their leading key columns (every column stays in `--json` whatever is
printed). `backends_arg` is the one parser of `--backends`.

matplotlib is an optional extra (`pip install '/path/to/pdxfer[plot]'`); `--plot` asks
for it only when used and says how to get it when missing. `figure` puts
the legend beside the axes, never over the data, and `log_if_dwarfed` says
when a panel's values span so much that a linear axis would flatten all but
the largest; `unify` gives a figure one style per series, one y scale, and
linear ticks in plain numbers (never "+1.521e3" in the corner). A saved figure carries which bench drew it and a digest of the
code that measured and drew it (`source_digest`), so a committed figure that
today's code would draw differently is caught by the figure test instead of
contradicting the table beside it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from ..cliargs import bounded_int, name_list

# A run shorter than this prints no progress at all: a quick run stays quiet.
PROGRESS_AFTER_S = 3.0
# ... and a longer one prints at most one line per this many seconds (and its last).
PROGRESS_EVERY_S = 2.0


def machine() -> dict[str, Any]:
    """The facts a figure depends on: host, CPU, cores, load, library versions."""
    import numpy
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "loadavg": load, "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__,
        "cuda": torch.cuda.is_available(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def machine_line() -> str:
    """One comment line naming the machine, for the top of a printed table."""
    m = machine()
    load = "" if m["loadavg"] is None else f", load {m['loadavg'][0]:.1f}"
    return (f"# {m['host']} {m['cpu']}, {m['cores']} cores{load}, python {m['python']}, "
            f"torch {m['torch']}")


def add_output_args(parser: argparse.ArgumentParser, plot: bool = True) -> None:
    """`--json PATH`, `--width N` (and `--plot PATH`) with the same words in every bench."""
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help="write every raw sample, every column, the machine and the backends as JSON")
    parser.add_argument("--width", metavar="N", type=_width, default=None,
                        help="cut a table wider than N characters into narrower ones sharing the "
                             "key columns (default: the terminal's width, 80 when not a terminal; "
                             "0: one table however wide)")
    if plot:
        parser.add_argument("--plot", metavar="PATH", type=Path, default=None,
                            help="draw the figures to PATH (PNG/SVG; needs the plot extra: pip install matplotlib)")


# The run in progress, for `interrupted`: its latest Report and Progress and
# its --json path. A bench is one run per process (or per in-process call).
_LIVE: dict[str, Any] = {}


def interrupted(stream: TextIO | None = None) -> None:
    """On Ctrl-C: say how far the run got and write what it measured to its `--json`.

    A partial JSON carries `"interrupted": true` and every sample taken so far;
    its rows and legend are those of the cases that finished, if any.
    """
    stream = sys.stderr if stream is None else stream
    progress, report, path = _LIVE.get("progress"), _LIVE.get("report"), _LIVE.get("json")
    if progress is not None:
        stream.write(f"interrupted after {progress.done} of {progress.total} {progress.what}\n")
    else:
        stream.write("interrupted before the first case finished\n")
    if report is not None and path is not None:
        report.data["interrupted"] = True
        path.write_text(json.dumps(report.data, indent=1, default=float) + "\n")
        stream.write(f"# wrote {len(report.data['samples'])} raw samples (partial) to {path}\n")
    stream.flush()
    _LIVE.clear()


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse unwritable output paths and a missing matplotlib before measuring anything."""
    _LIVE.clear()
    _LIVE["json"] = getattr(args, "json", None)
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        parent = path.resolve().parent
        if path.is_dir():
            parser.error(f"--{flag} {path} is a directory; name a file in it, "
                         f"e.g. --{flag} {path / ('bench.' + ('json' if flag == 'json' else 'png'))}")
        if not parent.is_dir():
            parser.error(f"--{flag} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            parser.error(f"--{flag} {path}: directory {parent} is not writable")
    if getattr(args, "plot", None) is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is an optional extra: "
                         "pip install 'pdxfer[plot]' (or pip install matplotlib)")


class Progress:
    """`rows done/total, elapsed, ETA` on stderr once a run has taken a few seconds."""

    def __init__(self, total: int, what: str = "rows", stream: TextIO | None = None,
                 after_s: float | None = None, every_s: float | None = None) -> None:
        self.total, self.what, self.done = total, what, 0
        self.stream = sys.stderr if stream is None else stream
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.started = time.monotonic()
        self.last = float("-inf")
        self.shown = False
        _LIVE["progress"] = self

    def step(self, label: str = "") -> None:
        """One row finished."""
        self.done += 1
        elapsed = time.monotonic() - self.started
        last = self.done == self.total
        if elapsed < self.after_s or (elapsed - self.last < self.every_s and not last):
            return
        self.last = elapsed
        eta = elapsed / self.done * (self.total - self.done)
        self.stream.write(f"[{self.done}/{self.total} {self.what}, {elapsed:.0f} s elapsed, "
                          f"ETA {eta:.0f} s] {label}\n")
        self.stream.flush()
        self.shown = True


class Report:
    """Every raw sample of one bench run, with the machine and backends, for `--json`."""

    def __init__(self, bench: str, backends: Iterable[str], params: dict[str, Any]) -> None:
        self.data: dict[str, Any] = {
            "bench": bench, "machine": machine(), "backends": list(backends),
            "params": params, "columns": {}, "samples": [], "rows": [],
        }
        _LIVE["report"] = self

    def sample(self, **fields: Any) -> None:
        """One raw measurement (a list of seconds, a per-request figure...) with its case."""
        self.data["samples"].append(fields)

    def row(self, row: dict[str, Any]) -> None:
        """One printed row, as numbers."""
        self.data["rows"].append(row)

    def finish(self, meanings: dict[str, str], shown: list[str], rows: Iterable[dict[str, Any]],
               out: Callable[[str], None] = print) -> None:
        """Print the legend of the columns shown and keep it, with every row, for `write`."""
        print_legend(meanings, shown, out)
        self.data["columns"] = meanings
        for r in rows:
            self.row(r)

    def note(self, extra: str) -> str:
        """A figure's footnote: the machine and its load at the start, then `extra`."""
        m = self.data["machine"]
        return f"{m['host']}, {m['cores']} cores, load {m['loadavg'][0]:.1f}, {extra}"

    def write(self, path: Path | None, columns: dict[str, str]) -> None:
        if path is None:
            return
        self.data["columns"] = columns
        path.write_text(json.dumps(self.data, indent=1, default=float) + "\n")
        print(f"# wrote {len(self.data['samples'])} raw samples to {path}", file=sys.stderr)


def print_legend(columns: dict[str, str], shown: Iterable[str],
                 out: Callable[[str], None] = print) -> None:
    """`column: meaning` for every column the table shows, in its order."""
    out("")
    out("columns:")
    for name in shown:
        out(f"  {name}: {columns[name]}")


# What a printed figure takes at most (e.g. "12345.6", "0.85x"): a column is
# as wide as its header or this, whichever is wider.
_VALUE_WIDTH = 7


_width = bounded_int(0, 10_000)


def terminal_width(width: int | None) -> int:
    """`--width` as given, else the terminal's columns (80 when stdout is not a terminal)."""
    return shutil.get_terminal_size((80, 24)).columns if width is None else width


def fit(columns: list[str], keys: int, width: int) -> list[list[str]]:
    """`columns` cut into groups whose markdown lines fit `width`, each led by the first `keys`.

    A column takes `| ` + max(header, a figure) + ` `; one too wide for any
    group gets a group of its own. `width` 0 keeps one group.
    """
    def cell(c: str) -> int:
        return max(len(c), _VALUE_WIDTH) + 3

    lead, rest = columns[:keys], columns[keys:]
    if not width:
        return [columns]
    base = 1 + sum(cell(c) for c in lead)
    groups: list[list[str]] = []
    current: list[str] = []
    used = base
    for c in rest:
        if current and used + cell(c) > width:
            groups.append(lead + current)
            current, used = [], base
        current.append(c)
        used += cell(c)
    groups.append(lead + current)
    return groups


class Table:
    """A markdown table: rows print as they come when it fits `width`, else as groups at `close()`.

    Call it with one row (a dict column -> text); `close()` prints what was
    held back. Grouped tables repeat the first `keys` columns so every row
    can be read on its own.
    """

    def __init__(self, columns: list[str], out: Callable[[str], None], width: int = 0,
                 keys: int = 1) -> None:
        self.columns, self.out = columns, out
        self.groups = fit(columns, keys, width)
        self.held: list[dict[str, str]] = []
        if len(self.groups) == 1:
            self._header(columns)

    def _header(self, columns: list[str]) -> None:
        self.out("| " + " | ".join(columns) + " |")
        self.out("|" + " --- |" * len(columns))

    def _line(self, columns: list[str], row: dict[str, str]) -> None:
        self.out("| " + " | ".join(row.get(c, "") for c in columns) + " |")

    def __call__(self, row: dict[str, str]) -> None:
        if len(self.groups) == 1:
            self._line(self.columns, row)
        else:
            self.held.append(row)

    def close(self) -> None:
        """Print the grouped tables (nothing when the rows already printed)."""
        if len(self.groups) == 1:
            return
        for i, group in enumerate(self.groups):
            if i:
                self.out("")
            self._header(group)
            for row in self.held:
                self._line(group, row)
        self.held = []


def markdown(columns: list[str], out: Callable[[str], None], width: int = 0,
             keys: int = 1) -> Table:
    """A `Table` over `columns` (its header printed now when it fits `width`)."""
    return Table(columns, out, width, keys)


def log_if_dwarfed(ax: Any, values: Iterable[float], ratio: float = 20.0) -> None:
    """A log y axis when the largest positive value is over `ratio` times the smallest.

    On a linear axis such a panel shows the largest series and a flat line
    for the rest (nixl's 50 requests/s beside loopback's 2,000).
    """
    positive = [v for v in values if v and v > 0]
    if positive and max(positive) > ratio * min(positive):
        to_log(ax)


def to_log(ax: Any) -> None:
    """Turn `ax`'s y axis log, keeping its own tick labels (`time_axis`) and saying so.

    matplotlib's `set_yscale` resets the formatter to powers of ten; a panel
    without tick labels of its own gets plain numbers (0.2, 1, 2000).
    """
    from matplotlib.ticker import FuncFormatter

    own = ax.yaxis.get_major_formatter()
    if ax.get_yscale() != "log":
        ax.set_yscale("log")
        ax.set_ylabel((ax.get_ylabel() or "") + " (log)")
    if not isinstance(own, FuncFormatter):
        own = FuncFormatter(lambda v, _: f"{v:g}")

    def minor(v: float, pos: Any) -> str:
        # A panel spanning under two decades has one or two major ticks at
        # most: label its 2x and 5x ticks too, or a reader sees a lone "1".
        lo, hi = sorted(ax.get_ylim())
        if v <= 0 or lo <= 0 or hi / lo > 100:
            return ""
        mantissa = round(v / 10 ** math.floor(math.log10(v)), 6)
        return own(v, pos) if mantissa in (2, 5) else ""

    ax.yaxis.set_major_formatter(own)
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


# Every labelled series of a figure gets its own (colour, marker): matplotlib's
# default cycle has 10 colours, and the transport figure draws a dozen series,
# so pairs of them shared a colour. tab20's colours with ten markers keep 20
# series apart by colour and any two apart by the pair.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", "h")


def style(i: int) -> tuple[Any, str]:
    """The `i`-th series' (colour, marker) of a figure."""
    import matplotlib

    return matplotlib.colormaps["tab20"](i % 20), _MARKERS[i % len(_MARKERS)]


def unify(fig: Any) -> None:
    """One style per label across the figure's lines, and one y scale across its panels.

    A panel that went log (`log_if_dwarfed`) takes every panel with data to
    log, so a reader never compares a linear panel with a log one. A linear
    axis ticks in its values as they are (1521.0, 1521.1), never against an
    offset or a power ("+1.521e3", "1e−6") that matplotlib puts in the
    corner when the values sit close together or far from 1.
    """
    labels: dict[str, tuple[Any, str]] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith("_"):
                continue
            color, marker = labels.setdefault(label, style(len(labels)))
            line.set_color(color)
            line.set_marker(marker)
    panels = [ax for ax in fig.axes if ax.has_data()]
    if any(ax.get_yscale() == "log" for ax in panels):
        for ax in panels:
            to_log(ax)
    for ax in fig.axes:
        _plain(ax)


def _plain(ax: Any) -> None:
    """`ax`'s linear axes tick in plain numbers: no offset, no power of ten in the corner.

    Left to itself, matplotlib's `ScalarFormatter` labels two RSS points of
    1521.0 and 1521.3 MiB as 0.00 ... 0.30 with "+1.521e3" above the axis:
    a reader has to add the two. Axes with their own labels (`time_axis`,
    `bytes_axis`, log axes, fixed ticks) are not `ScalarFormatter`s and keep them.
    """
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)


def human_bytes(n: float) -> str:
    """4096 -> '4 KiB', 4194304 -> '4 MiB': tick labels a reader need not convert."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def human_seconds(s: float) -> str:
    """0.00025 -> '250 µs', 0.012 -> '12 ms', 2 -> '2 s': time ticks in the unit a reader uses."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= size:
            return f"{s / size:g} {unit}"
    return f"{s * 1e9:g} ns" if s else "0"


def time_axis(ax: Any, scale: float = 1.0) -> None:
    """Label `ax`'s y ticks in µs/ms/s; its values are seconds divided by `scale`.

    `to_log` (and so `log_if_dwarfed`, `unify`) keeps these labels; a direct
    `ax.set_yscale` after this call drops them.
    """
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_seconds(v * scale)))


def bytes_axis(ax: Any, scale: float = 1.0) -> None:
    """Label `ax`'s x ticks in KiB/MiB; its values are bytes divided by `scale`."""
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v * scale)))


def figure_problems(fig: Any) -> list[str]:
    """What breaks the figure rules: two labels sharing a style, one label in two styles,
    panels on different y scales, ticks in powers or against an offset. Empty when the
    figure is fine (the figure test asks)."""
    problems: list[str] = []
    seen: dict[str, tuple] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith("_"):
                continue
            key = (tuple(matplotlib_rgba(line.get_color())), line.get_marker(), line.get_linestyle())
            if seen.setdefault(label, key) != key:
                problems.append(f"{label!r} is drawn in two styles")
    by_style: dict[tuple, list[str]] = {}
    for label, key in seen.items():
        by_style.setdefault(key, []).append(label)
    problems += [f"{', '.join(map(repr, ls))} share one style" for ls in by_style.values() if len(ls) > 1]
    scales = {ax.get_yscale() for ax in fig.axes if ax.has_data()}
    if len(scales) > 1:
        problems.append(f"panels on different y scales: {sorted(scales)}")
    fig.canvas.draw()  # tick labels exist once drawn
    for ax in fig.axes:
        for axis in ("x", "y"):
            ticks = getattr(ax, f"get_{axis}ticklabels")(which="both")
            powers = [t.get_text() for t in ticks if _POWERS.search(t.get_text())]
            if powers:
                problems.append(f"{axis} ticks of {ax.get_title()!r} in powers, not units a "
                                f"reader uses: {powers[:3]}")
            offset = getattr(ax, f"{axis}axis").get_offset_text().get_text()
            if offset:  # "1e−6" (a Unicode minus) is a power too, and "+1521" no unit at all
                problems.append(f"{axis} ticks of {ax.get_title()!r} read against an offset "
                                f"in the corner: {offset!r}")
    return problems


# 2^6, 10^3, 2x10^0, 1e+03, 1e−6 (matplotlib writes a Unicode minus): powers, not units.
_POWERS = re.compile(r"\^|\\times|\de[+\-−]?\d")


def matplotlib_rgba(color: Any) -> tuple[float, ...]:
    """`color` as an RGBA tuple (a name and its hex compare equal)."""
    from matplotlib.colors import to_rgba

    return to_rgba(color)


def compose(plt: Any, draw: Callable[[Any], None], title: str, note: str = "") -> Any:
    """Run `draw(pyplot)`, then title it and put one legend beside the axes; returns the figure.

    `draw` labels its lines and bars but places no legend: the legend goes to
    the right of every panel (one entry per label, whichever panel drew it),
    so it never hides data; `note` (the machine, its load) goes under the title.
    """
    draw(plt)
    fig = plt.gcf()
    unify(fig)
    handles: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=9)
    fig.tight_layout()
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    return fig


def figure(path: Path, draw: Callable[[Any], None], title: str, note: str = "") -> None:
    """`compose` headless and save to `path` (the legend outside the axes included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = draw.__module__  # the bench module whose `plot` defined `draw`
    stamp = {BENCH_KEY: bench, SOURCE_KEY: source_digest(bench)}
    try:
        compose(plt, draw, title, note).savefig(path, dpi=110, bbox_inches="tight", metadata=stamp)
    finally:
        plt.close("all")
    print(f"# plot written to {path}", file=sys.stderr)


# A saved figure's PNG text chunks: which bench module drew it, and the digest of
# the code it depends on at the time (`source_digest`).
BENCH_KEY = "pdxfer-bench"
SOURCE_KEY = "pdxfer-source"
# Modules outside pdxfer.bench that a figure's numbers depend on: the model
# shapes `bench layouts` ships. The engine itself is not here: a figure is
# "the numbers this bench measured on that day", not a claim about every later
# engine change.
_WORKLOADS = ("pdxfer.layout_example",)


def figure_sources(module: str) -> list[Path]:
    """The files a figure drawn by bench `module` depends on.

    The module, the `pdxfer.bench` modules it imports or names as a child
    process's module (at any depth, inside functions too) and the workload
    modules among its imports:
    the code that measures and draws, found from the imports themselves so a
    new helper module counts without editing a list.
    """
    import importlib.util

    def file_of(name: str) -> Path | None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a parent that is not a package
            return None
        return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None

    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = None if name in seen else file_of(name)
        if path is None:
            continue
        seen[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                found = [stem] + [f"{stem}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # a child process's module, `module="pdxfer.bench.fleet"` (not a workload
                # named in a string, as `_WORKLOADS` below does)
                found = [node.value] if node.value.startswith("pdxfer.bench.") else []
            todo += [f for f in found if f in _WORKLOADS or (
                f.startswith("pdxfer.bench.") and f != "pdxfer.bench")]
    return sorted(seen.values())


def source_digest(module: str) -> str:
    """sha256 of the code a figure of bench `module` depends on (`figure_sources`).

    Docstrings, comment-only lines and blank lines are left out, so explaining
    the code better does not make every committed figure stale; any other
    change does.
    """
    digest = hashlib.sha256()
    for path in figure_sources(module):
        text = path.read_text()
        skip: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                skip.update(range(body[0].lineno, body[0].end_lineno + 1))
        kept = [line.rstrip() for n, line in enumerate(text.splitlines(), 1)
                if n not in skip and line.strip() and not line.lstrip().startswith("#")]
        digest.update(path.name.encode() + b"\0" + "\n".join(kept).encode() + b"\0")
    return digest.hexdigest()


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (where `figure` records who drew it)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    out, at = {}, 8
    while at + 8 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        at += 12 + size
    return out


# What `--tiny` runs when `--backends` is not given: the two every host has,
# which set up in milliseconds (a NIXL agent takes a second or more).
TINY_BACKENDS = ("loopback", "tcp")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for a run, then put back.

    The count is process-wide: a bench run in-process (the CLI tests, the
    docs test) must not leave the rest of the process on one thread.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def backends_arg(parser: argparse.ArgumentParser, text: str | None, variants: bool = False,
                 tiny: bool = False) -> list[str]:
    """`--backends a,b` as names, or the usage error naming the choices.

    None means every installed backend — `TINY_BACKENDS` for a `--tiny` run.
    `variants` also accepts (and by default runs) the registry's variants,
    e.g. `nixl-all`, which only the transport bench measures.
    """
    from pdxfer import transport  # here, not at the top: `bench layouts --help` need not load it

    installed = transport.available() + (transport.variants() if variants else [])
    if text is None:
        names = [b for b in installed if b in TINY_BACKENDS] if tiny else installed
    else:
        try:
            names = name_list(text)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--backends: {exc}")
    unknown = sorted(set(names) - set(installed))
    if unknown or not names:
        parser.error(f"backends {unknown} are not installed; choose from {', '.join(installed)}")
    return names
