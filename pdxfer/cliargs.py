"""Argument types shared by `pdxfer` subcommands and the example launchers.

A command-line tool answers a bad flag with one line naming the flag, the
value and the range, and exit status 2 — never a traceback from deep inside
the run. argparse does exactly that for a `type=` callable that raises
`ArgumentTypeError`, so every range rule lives here as such a callable and
each parser states its ranges where it declares the flag. One place words
each rule, so the benches and the examples refuse alike.
"""

from __future__ import annotations

import argparse
import errno
import socket
from collections.abc import Callable

__all__ = ["bounded_int", "check_ports_free", "device_name", "positive_float"]


def bounded_int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse `type` accepting integers in `minimum..maximum` (inclusive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            span = f"{minimum}..{maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"{value} is out of range; it must be {span}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message
    return parse


def positive_float(text: str) -> float:
    """An argparse `type` accepting a finite float > 0 (timeouts, durations)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; it must be a finite number > 0")
    return value


def device_name(text: str) -> str:
    """An argparse `type` for `--device`: cpu, cuda[:N] (only when CUDA is there), or auto."""
    import torch  # here, not at import: `pdxfer --help` should not pay for torch

    name = text.strip().lower()
    if name in ("auto", "cpu"):
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but this torch ({torch.__version__}) sees no CUDA device; "
                "use --device cpu (or auto)"
            )
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has CUDA devices 0..{torch.cuda.device_count() - 1}"
            )
        return name
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose cpu, cuda[:N] or auto")


def check_ports_free(parser: argparse.ArgumentParser, host: str, ports: dict[str, int]) -> None:
    """`parser.error` naming the flag whose fixed port is already taken on `host`.

    A listener that cannot bind fails deep in a constructor with EADDRINUSE
    and no hint of which of a worker's three ports it was; probing each fixed
    (non-zero) port first lets the message name the flag to change. Port 0
    is never probed: the kernel picks a free one.
    """
    for flag, port in ports.items():
        if not port:
            continue
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                parser.error(f"{flag} {port}: that port is already in use on {host}; "
                             f"pass another {flag}, or 0 to let the kernel pick one")
            parser.error(f"{flag} {port}: cannot bind {host}:{port} ({exc.strerror})")
        finally:
            probe.close()
