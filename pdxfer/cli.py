"""`pdxfer` on the command line: inspect layouts, diagnose hosts and peers, run benchmarks.

Each subcommand lives in the module that owns its topic and is imported only
when asked for, so `pdxfer layout` does not pay for sockets and
`pdxfer bench transport` does not pay for the PD engine. This module only
parses the command words and dispatches the rest of the line to the
subcommand's own parser; it is also the one place (with the launchers)
allowed to read environment variables.

It behaves like a tool: a missing or unknown command word is argparse's
usage error with exit status 2, `--help` exits 0, `--version` prints the
installed version.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

# command -> subcommand -> (module, help); "" is a command without subcommands.
# Each module exposes `main(argv) -> int` with a parser of its own.
_COMMANDS: dict[str, dict[str, tuple[str, str]]] = {
    "layout": {"": ("pdxfer.layout_example", "print the entry maps of an example hybrid model")},
    "doctor": {"": ("pdxfer.doctor", "what this host can run: transports, memlock, RDMA, CUDA, UCX, etcd")},
    "probe": {"": ("pdxfer.probe", "dial a prefill as a decode would: who answers, layout "
                                   "differences, a checked write; exit status by cause")},
    "bench": {
        "transport": ("pdxfer.bench.transport", "transport throughput vs memcpy and raw sockets"),
        "engine": ("pdxfer.bench.engine", "PD engine requests/s and per-request overhead"),
        "layouts": ("pdxfer.bench.layouts",
                    "one model state shipped entry-major, layer-major and via a staging copy"),
        "request-cost": ("pdxfer.bench.request_cost",
                         "CPU per send()/expect() call, split into plan/post/bookkeeping"),
        "tp": ("pdxfer.bench.tp", "heterogeneous TP: shard-major vs per-token/per-head slicing"),
        "chunked": ("pdxfer.bench.chunked", "chunked prefill: transfer hidden behind compute vs sending after"),
        "layerwise": ("pdxfer.bench.layerwise",
                      "streamed layer groups: transfer hidden behind the forward pass vs whole entries"),
        "scaling": ("pdxfer.bench.scaling", "GB/s and us per request against request size, entry- vs layer-major"),
        "elastic": ("pdxfer.bench.elastic", "moving a page/state pool boundary: relocation GB/s, entries moved"),
        "directory": ("pdxfer.bench.directory",
                      "peer directory on etcd: registrations/s, resolve latency, departure seen"),
        "peers": ("pdxfer.bench.peers", "one prefill, 1..128 decode peers: req/s, p99, memory and threads"),
    },
}


def version() -> str:
    """The installed distribution's version (what `pip show pdxfer` says)."""
    try:
        return metadata.version("pdxfer")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    if command is None:
        parser = argparse.ArgumentParser(
            prog="pdxfer", description="pdxfer: KV/state transfer for disaggregated serving",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="commands:\n" + "\n".join(
                f"  pdxfer {c}{' ' + s if s else ''}: {h}"
                for c, subs in _COMMANDS.items() for s, (_, h) in subs.items()),
        )
        parser.add_argument("--version", action="version", version=f"pdxfer {version()}")
        parser.add_argument("command", choices=list(_COMMANDS), help="what to run")
    else:
        subs = _COMMANDS[command]
        parser = argparse.ArgumentParser(
            prog=f"pdxfer {command}", formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="\n".join(f"  pdxfer {command} {s}: {h}" for s, (_, h) in subs.items()),
        )
        parser.add_argument("which", choices=list(subs), help=f"which {command} to run")
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` cut after its first word that is not an option: ours, and the rest.

    The rest goes to the next parser untouched, so `pdxfer layout --help` is
    the subcommand's help, not ours.
    """
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return argv[: i + 1], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdxfer` console script."""
    head, rest = _split(list(sys.argv[1:] if argv is None else argv))
    command = _parser().parse_args(head).command
    subs = _COMMANDS[command]
    if "" in subs:
        module = subs[""][0]
    else:
        head, rest = _split(rest)
        module = subs[_parser(command).parse_args(head).which][0]
    if command != "bench":
        return int(importlib.import_module(module).main(rest) or 0)
    report = importlib.import_module("pdxfer.bench.report")  # by name: see the module docstring
    try:
        return int(importlib.import_module(module).main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C: how far it got, and the samples so far
        report.interrupted()
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
