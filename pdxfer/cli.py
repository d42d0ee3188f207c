"""`pdxfer` on the command line: inspect layouts and run benchmarks.

Each subcommand lives in the module that owns its topic and is imported only
when asked for, so `pdxfer layout` does not pay for sockets and
`pdxfer bench transport` does not pay for the PD engine. This module only
parses and dispatches; it is also the one place (with the launchers) allowed
to read environment variables.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand path -> (module, help). The module exposes `main(argv) -> int`.
_COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("layout",): ("pdxfer.layout_example", "print the entry maps of an example hybrid model"),
    ("bench", "transport"): ("pdxfer.bench_transport", "transport throughput vs memcpy and raw sockets"),
    ("bench", "engine"): ("pdxfer.bench_engine", "PD engine requests/s and per-request overhead"),
    ("bench", "tp"): ("pdxfer.bench_tp", "heterogeneous TP: shard-major vs per-token/per-head slicing"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdxfer` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for path, (module, _) in sorted(_COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(path)]) == path:
            rest = argv[len(path):]
            return int(importlib.import_module(module).main(rest) or 0)
    parser = argparse.ArgumentParser(prog="pdxfer", description="pdxfer command line")
    parser.epilog = "commands:\n" + "\n".join(
        f"  pdxfer {' '.join(p)}: {h}" for p, (_, h) in _COMMANDS.items()
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.parse_args(argv[:1] if argv and argv[0] in ("-h", "--help") else ["--help"])
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
