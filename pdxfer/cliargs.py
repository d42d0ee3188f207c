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
import math
import socket
import urllib.parse
from collections.abc import Callable

__all__ = ["bounded_float", "bounded_int", "byte_size", "check_ports_free", "device_name",
           "etcd_url", "host_port", "int_list", "listen_address", "name_list", "positive_float"]


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


def bounded_float(minimum: float, maximum: float) -> Callable[[str], float]:
    """An argparse `type` accepting a finite float in `minimum..maximum` (inclusive).

    A bound on both sides: a `--ttl 1e30` is not a long run, it is an
    overflow somewhere inside (an etcd lease counts whole seconds in an int64).
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise argparse.ArgumentTypeError(
                f"{text} is out of range; it must be a number in {minimum:g}..{maximum:g}")
        return value

    parse.__name__ = "float"
    return parse


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def byte_size(text: str) -> int:
    """An argparse `type` for a byte count: `4096`, `512MiB`, `80GiB`, `1T` (binary units), > 0."""
    body = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = body[-1:] if body[-1:] in _UNITS and not body[-1:].isdigit() else ""
    number = body[: len(body) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 4096, 512MiB or 80GiB, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value * _UNITS[unit] <= 2**60):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; it must be 1 byte..1 EiB")
    return int(value * _UNITS[unit])


def int_list(minimum: int, maximum: int) -> Callable[[str], list[int]]:
    """An argparse `type` for `1,2,4`: distinct integers in `minimum..maximum`, none empty."""
    one = bounded_int(minimum, maximum)

    def parse(text: str) -> list[int]:
        items = text.split(",")
        if not text or any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(
                f"{text!r} has an empty item; give comma-separated integers like 1,2,4")
        values = [one(item.strip()) for item in items]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{text!r} names a value twice")
        return values

    parse.__name__ = "list"
    return parse


def name_list(text: str) -> list[str]:
    """An argparse `type` for `tcp,nixl`: distinct names, none empty (the caller checks them)."""
    items = [item.strip() for item in text.split(",")]
    if not text or any(not item for item in items):
        raise argparse.ArgumentTypeError(
            f"{text!r} has an empty item; give comma-separated names like tcp,nixl")
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r} names {_twice(items)!r} twice")
    return items


def _twice(items: list[str]) -> str:
    return next(item for i, item in enumerate(items) if item in items[:i])


def _port(text: str, whole: str, minimum: int) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{whole!r}: the port {text!r} is not a number")
    port = int(text)
    if not minimum <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{whole!r}: port {port} is out of range; it must be "
                                         f"{minimum}..65535")
    return port


def host_port(text: str) -> tuple[str, int]:
    """An argparse `type` for `--connect HOST:PORT` (`[v6]:PORT` too): `(host, port)`."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} has no {'host' if sep else 'port'}; "
                                         "give HOST:PORT (e.g. 10.0.0.2:7400)")
    return host, _port(port, text, 1)


def listen_address(text: str) -> tuple[str, int]:
    """An argparse `type` for `--listen [HOST:]PORT`: `(host, port)`; every address by default.

    Port 0 lets the kernel pick one (the listener prints it).
    """
    if ":" not in text:
        return "0.0.0.0", _port(text, text, 0)
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise argparse.ArgumentTypeError(f"{text!r} has an empty host; give PORT or HOST:PORT")
    return host, _port(port, text, 0)


def etcd_url(text: str) -> str:
    """An argparse `type` for an etcd client URL: http(s)://HOST:PORT, nothing after the port."""
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an etcd client URL; give http://HOST:PORT (e.g. http://127.0.0.1:2379)")
    return text


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
