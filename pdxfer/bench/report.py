"""What every `pdxfer bench ...` shares: progress, raw samples, legend, plots.

A benchmark's printed table is a summary (medians, ratios); this module keeps
the rest of the evidence. `Report` holds every timed sample with the case it
belongs to, the machine and the backends used, and writes them as JSON
(`--json PATH`) so a reader can recompute any figure or plot it differently.
`Progress` tells a person waiting on a long run how far it is (rows done,
elapsed, ETA) on stderr, so stdout stays the table. `print_legend` explains
every column the table printed, from the same dict the bench used to pick
its columns, so a column cannot appear without its meaning.

matplotlib is an optional extra (`pip install pdxfer[plot]`); `--plot` asks
for it only when used and says how to get it when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

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
    """`--json PATH` (and `--plot PATH`) with the same words in every bench."""
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help="write every raw sample, the machine and the backends as JSON")
    if plot:
        parser.add_argument("--plot", metavar="PATH", type=Path, default=None,
                            help="draw the figures to PATH (PNG/SVG; needs pip install pdxfer[plot])")


def backends(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """`--backends a,b` as a list, or `parser.error` naming the ones not installed."""
    from pdxfer import transport  # here: `pdxfer bench --help` should not import the backends

    names = [b for b in text.split(",") if b]
    unknown = sorted(set(names) - set(transport.available()))
    if unknown or not names:
        parser.error(f"backends {unknown} are not installed; choose from {', '.join(transport.available())}")
    return names


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse unwritable output paths and a missing matplotlib before measuring anything."""
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path is not None and not path.resolve().parent.is_dir():
            parser.error(f"--{flag} {path}: directory {path.resolve().parent} does not exist")
    if getattr(args, "plot", None) is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is an optional extra: "
                         "pip install 'pdxfer[plot]' (or pip install matplotlib)")


class Progress:
    """`rows done/total, elapsed, ETA` on stderr once a run has taken a few seconds."""

    def __init__(self, total: int, what: str = "rows", stream: TextIO | None = None,
                 after_s: float = PROGRESS_AFTER_S, every_s: float = PROGRESS_EVERY_S) -> None:
        self.total, self.what, self.done = total, what, 0
        self.stream = sys.stderr if stream is None else stream
        self.after_s, self.every_s = after_s, every_s
        self.started = time.monotonic()
        self.last = float("-inf")
        self.shown = False

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


def markdown(columns: list[str], out: Callable[[str], None]) -> Callable[[dict[str, str]], None]:
    """Print a markdown header for `columns`; returns a function printing one row dict."""
    out("| " + " | ".join(columns) + " |")
    out("|" + " --- |" * len(columns))
    return lambda row: out("| " + " | ".join(row.get(c, "") for c in columns) + " |")


def figure(path: Path, draw: Callable[[Any], None], title: str) -> None:
    """Draw with `draw(pyplot)` and save to `path`, headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw(plt)
    plt.suptitle(title, fontsize=9)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    print(f"# plot written to {path}", file=sys.stderr)


def backends_arg(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated `--backends` value as names, or the parser's usage error naming the choices."""
    from pdxfer import transport  # here, not at the top: `bench layouts --help` need not load it

    names = [b for b in text.split(",") if b]
    unknown = sorted(set(names) - set(transport.available()))
    if unknown or not names:
        parser.error(f"backends {unknown} are not installed; choose from "
                     f"{', '.join(transport.available())}")
    return names
