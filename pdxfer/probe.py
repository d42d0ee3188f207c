"""`pdxfer probe HOST:PORT`: dial a prefill as a decode would, and say what answers.

An operator whose decode cannot reach a prefill wants one command that tells
which of the causes it is: nothing listens there, something listens but does
not answer (a stopped or hung process), it speaks another protocol version,
it uses another transport, its pools are not ours — with every difference
named, not only the first — or the handshake works and the bytes do not.

The probe speaks the engines' own words, in the engines' own order: the
`Hello` a `DecodeEngine` sends (built from `PoolSet.hello_fields`, over a
transport engine of the asked backend with the local declaration's pools
registered, so the prefill opens its data connection back to us as it would
to a decode), then the prefill's `Welcome` or `Refuse` (`protocol`). Nothing
here decides compatibility: `pools.differences` says what `pools.mismatch`
would refuse for, all of it. The data path is checked with `Echo`: the prefill
writes `echo_pattern` from a buffer of its own into one of our regions over
that data connection, the way request bytes travel, and every byte is
compared (`pdxfer.echo` is the prefill's half).

The prefill sees a decode link come and go: a Hello, a Welcome, an echo, a
close — no request, nothing logged at WARNING (a refused probe is logged
once, as a refused decode is). The control link is a blocking socket read
with a deadline: the probe is a one-shot client, and every wait ends by
`--timeout` (the whole probe's bound, each step given what is left).

Exit status by cause (`Exit`), so a script can tell them apart:
0 ok, 2 usage error, 3 unreachable, 4 no answer (stalled), 5 protocol
mismatch, 6 transport mismatch, 7 layout mismatch, 8 data-path failure.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from pdxfer import transport as transports
from pdxfer.transport.errors import PeerLostError, ProtocolError, TransferTimeout
from pdxfer.transport.wire import LENGTH, ErrorMessage, recv_exact

from .cliargs import byte_size, positive_float
from .errors import RequestError
from .pools import PoolSet, differences
from .protocol import (
    CONTROL,
    MAX_ECHO,
    VERSION,
    Echo,
    EchoDone,
    Hello,
    Ping,
    Refuse,
    Welcome,
    echo_pattern,
)
from .resolver import numeric, resolve_blocking
from .session import format_address, parse_address

__all__ = ["Exit", "ProbeReport", "load_layout", "main", "probe"]

# The small echo, timed for the round trip; the large one (`--bytes`) for bandwidth.
_SMALL_ECHO = 4096


class Exit(enum.IntEnum):
    """`pdxfer probe`'s exit status, one per cause."""

    OK = 0
    USAGE = 2  # argparse's
    UNREACHABLE = 3  # the name does not resolve, or nothing accepts the connection
    NO_ANSWER = 4  # connected, but no answer to the Hello within the timeout, or hung up silent
    PROTOCOL_MISMATCH = 5  # not pdxfer's control protocol, or another version of it
    TRANSPORT_MISMATCH = 6  # the prefill uses another transport
    LAYOUT_MISMATCH = 7  # the prefill's pools differ from the local declaration
    DATA_PATH_FAILED = 8  # the handshake worked; the data connection or the echo did not


@dataclass
class ProbeReport:
    """What one probe found; `outcome` is `Exit`'s name in lower case, `detail` the sentence."""

    address: str
    outcome: str
    exit_code: int
    detail: str
    engine: str | None = None  # the prefill's engine id
    transport: str | None = None  # the prefill's transport
    protocol: int | None = None  # the prefill's control protocol version
    connect_s: float | None = None  # TCP connect of the control link
    handshake_s: float | None = None  # Hello sent -> Welcome/Refuse (the prefill dialled us back)
    pools: list[str] = field(default_factory=list)  # the local declaration's pool names
    differences: list[str] = field(default_factory=list)  # every layout difference, pool named
    echo: list[dict] = field(default_factory=list)  # per echo: nbytes, round_trip_s, wire_s, ok

    def text(self) -> str:
        """The report as a few lines for a terminal."""
        head = f"pdxfer probe {self.address}: {self.outcome.replace('_', ' ')} (exit {self.exit_code})"
        lines = [head, f"  {self.detail}"]
        if self.engine is not None:
            lines.append(f"  answered by: engine {self.engine}, transport {self.transport}, "
                         f"protocol pdxfer-ctl v{self.protocol}")
        elif self.protocol is not None:
            lines.append(f"  answered in: protocol pdxfer-ctl v{self.protocol} (this probe: v{VERSION})")
        if self.connect_s is not None:
            lines.append(f"  connect {self.connect_s * 1e3:.2f} ms" + (
                f", handshake {self.handshake_s * 1e3:.2f} ms (Hello to answer; a Welcome comes "
                "once the prefill's data connection to this probe is open)"
                if self.handshake_s is not None else ""))
        if self.differences:
            lines.append("  layout differences (prefill vs this declaration):")
            lines += [f"    {d}" for d in self.differences]
        elif self.outcome == "ok":
            lines.append(f"  layout: pools {', '.join(self.pools)} match")
        for e in self.echo:
            if e["ok"]:
                rate = e["nbytes"] / e["wire_s"] / 1e9 if e["wire_s"] > 0 else float("inf")
                lines.append(f"  echo {e['nbytes']} B: round trip {e['round_trip_s'] * 1e3:.2f} ms, "
                             f"wire {e['wire_s'] * 1e3:.2f} ms ({rate:.3f} GB/s), every byte checked")
            else:
                lines.append(f"  echo {e['nbytes']} B failed: {e['error']}")
        return "\n".join(lines)


class _Stop(Exception):
    """One probe step ended the probe: its exit status and the sentence saying why."""

    def __init__(self, code: Exit, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


def probe(address: str, pools: Mapping[str, Any], *, transport: str = "tcp", host: str | None = None,
          timeout: float = 5.0, echo_bytes: int = 1 << 20,
          transport_options: Mapping[str, Any] | None = None) -> ProbeReport:
    """Dial the prefill at `address` as a decode with `pools` would; what answered, and how.

    `host`: the address this probe's transport listens on for the prefill's
    data connection (default: the local address of the control connection,
    the interface that routes to the prefill). `timeout` bounds the whole
    probe. `echo_bytes` (1..`MAX_ECHO`, and at most the largest region of
    `pools`) sizes the bandwidth echo. Raises `RequestError` for a malformed
    address; every finding about the peer is in the report.
    """
    peer_host, port = parse_address(address)
    if isinstance(echo_bytes, bool) or not isinstance(echo_bytes, int) or not 0 < echo_bytes <= MAX_ECHO:
        raise RequestError(f"echo_bytes must be 1..{MAX_ECHO}, got {echo_bytes!r}")
    report = ProbeReport(address, "", 0, "", pools=list(pools))
    deadline = time.monotonic() + timeout
    sock = None
    try:
        sock = _connect(peer_host, port, deadline, report)
        _handshake_and_echo(sock, pools, transport, host or sock.getsockname()[0], timeout, deadline,
                            echo_bytes, dict(transport_options or {}), report)
        report.outcome, report.exit_code = "ok", int(Exit.OK)
    except _Stop as stop:
        report.outcome, report.exit_code, report.detail = stop.code.name.lower(), int(stop.code), stop.detail
    finally:
        if sock is not None:
            sock.close()
    return report


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _connect(host: str, port: int, deadline: float, report: ProbeReport) -> socket.socket:
    started = time.monotonic()
    errors = []
    for family, sockaddr in _resolve(host, port, deadline):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(_left(deadline))
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            errors.append(f"{format_address(sockaddr[0], sockaddr[1])}: "
                          f"{'no answer to the connection attempt' if isinstance(exc, TimeoutError) else exc}")
            continue
        report.connect_s = time.monotonic() - started
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise _Stop(Exit.UNREACHABLE, f"nothing accepts a connection at {report.address} "
                                  f"({'; '.join(errors)}): no prefill listens there, or a firewall "
                                  "drops it; check the prefill's bootstrap address and port")


def _resolve(host: str, port: int, deadline: float) -> list:
    """`(family, sockaddr)` pairs for `host`: a literal at once, a name on a worker, bounded."""
    addrs = numeric(host, port)
    if addrs is not None:
        return addrs
    box: dict[str, Any] = {}

    def look() -> None:  # getaddrinfo has no timeout of its own: a slow DNS must not outlast ours
        try:
            box["addrs"] = resolve_blocking(host, port)
        except OSError as exc:
            box["error"] = exc

    worker = threading.Thread(target=look, daemon=True, name="pdxfer-probe-resolve")
    worker.start()
    worker.join(_left(deadline))
    if "addrs" in box:
        return box["addrs"]
    raise _Stop(Exit.UNREACHABLE, f"cannot resolve {host!r}: "
                                  f"{box.get('error', 'no answer within --timeout')}")


def _handshake_and_echo(sock: socket.socket, pools: Mapping[str, Any], name: str, host: str,
                        timeout: float, deadline: float, echo_bytes: int, options: dict,
                        report: ProbeReport) -> None:
    """Hello, the answer, the echoes; raises `_Stop` for every cause but success."""
    engine = transports.create(name, host=host, connect_timeout=timeout, **options)
    try:
        ours = PoolSet(pools, engine)
        sent = time.monotonic()
        try:
            CONTROL.send(sock, Hello(engine.engine_id, name, engine.address(), **ours.hello_fields()))
        except PeerLostError as exc:
            raise _Stop(Exit.NO_ANSWER, f"the connection closed before the Hello went out: {exc}") from None
        answer = _recv(sock, deadline, timeout, "answer to the Hello", report)
        report.handshake_s = time.monotonic() - sent
        mine = (ours.descs, ours.fingerprints)
        if isinstance(answer, Refuse):
            _refused(answer, name, mine, report)
        if not isinstance(answer, Welcome):
            raise _Stop(Exit.PROTOCOL_MISMATCH, f"the prefill answered the Hello with {type(answer).TYPE!r}, "
                                       "not a Welcome or a Refuse")
        report.engine, report.transport, report.protocol = answer.engine, name, VERSION
        report.differences = differences((answer.pools, answer.fingerprints), mine)
        if report.differences:  # the prefill accepted what we refuse: an engine bug, say so
            raise _Stop(Exit.LAYOUT_MISMATCH, "the prefill welcomed this declaration, but its pools differ")
        region = max(ours.regions, key=lambda r: r.length)
        for xid, n in enumerate(dict.fromkeys((min(_SMALL_ECHO, echo_bytes), echo_bytes)), 1):
            _echo(sock, region, xid, min(n, region.length), deadline, timeout, report)
        report.detail = (f"handshake and data path work: the prefill opened its {name} data "
                         "connection to this probe and wrote every echoed byte right")
    finally:
        sock.close()  # first: the prefill cuts its data connection as a decode leaving, then ours
        engine.close()


def _refused(msg: Refuse, ours: str, mine: tuple[dict, dict], report: ProbeReport) -> None:
    report.engine, report.transport, report.protocol = msg.engine or None, msg.transport or None, VERSION
    if msg.kind == "layout":
        report.differences = differences((msg.pools, msg.fingerprints), mine) if msg.pools else [msg.reason]
        raise _Stop(Exit.LAYOUT_MISMATCH, f"the prefill refused this declaration: {len(report.differences)} "
                                 "difference(s); build both sides' pools from the same declaration")
    if msg.transport and msg.transport != ours:
        raise _Stop(Exit.TRANSPORT_MISMATCH, f"the prefill uses transport {msg.transport!r}, this probe "
                                    f"{ours!r}: probe again with --transport {msg.transport} (and "
                                    "configure the decodes with it)")
    raise _Stop(Exit.DATA_PATH_FAILED, f"the prefill could not open its data connection to this probe: "
                                f"{msg.reason}")


def _echo(sock: socket.socket, region: Any, xid: int, n: int, deadline: float, timeout: float,
          report: ProbeReport) -> None:
    dst = region.data[:n]
    dst.zero_()
    started = time.monotonic()
    rid = region.descriptor()["region"]
    try:
        CONTROL.send(sock, Echo(xid, n, rid))
    except PeerLostError as exc:
        raise _Stop(Exit.DATA_PATH_FAILED, f"the control link closed before the echo: {exc}") from None
    done = _recv(sock, deadline, timeout, f"answer to the {n} B echo", report, when=Exit.DATA_PATH_FAILED)
    rtt = time.monotonic() - started
    entry = {"nbytes": n, "round_trip_s": rtt, "wire_s": 0.0, "ok": False, "error": ""}
    report.echo.append(entry)
    if not isinstance(done, EchoDone) or done.xid != xid:
        raise _Stop(Exit.PROTOCOL_MISMATCH, f"expected the echo's answer, got {type(done).TYPE!r}")
    if not done.ok:
        entry["error"] = done.error
        raise _Stop(Exit.DATA_PATH_FAILED, f"the prefill's {n} B echo write failed: {done.error}")
    got = dst.cpu().numpy() if dst.device.type != "cpu" else dst.numpy()
    want = echo_pattern(n)
    bad = (got != want).nonzero()[0]
    if bad.size:
        entry["error"] = f"{bad.size} of {n} B wrong, first at offset {int(bad[0])}"
        raise _Stop(Exit.DATA_PATH_FAILED, f"the echo completed but {entry['error']}: the data path "
                                    "corrupts or misplaces bytes")
    entry.update(ok=True, wire_s=done.wire_s)


def _recv(sock: socket.socket, deadline: float, timeout: float, what: str, report: ProbeReport,
          when: Exit = Exit.NO_ANSWER) -> Any:
    """The next message other than a Ping, or `_Stop` naming the cause."""
    while True:
        try:
            head = recv_exact(sock, LENGTH.size, "prefill", deadline)
            (length,) = LENGTH.unpack(head)
            CONTROL.check_length(length)
            payload = recv_exact(sock, length, "prefill", deadline)
        except TransferTimeout:
            raise _Stop(when, f"connected, but no {what} within --timeout {timeout:g} s: the "
                              "prefill process is stopped, hung or overloaded (a stopped process's "
                              "kernel still accepts the connection)") from None
        except PeerLostError as exc:
            raise _Stop(when, f"the prefill closed the connection before its {what}: {exc}") from None
        except ProtocolError as exc:
            raise _Stop(Exit.PROTOCOL_MISMATCH, f"not a pdxfer prefill's control port: {exc}") from None
        try:
            msg = CONTROL.unpack(payload)
        except ProtocolError as exc:
            raise _Stop(Exit.PROTOCOL_MISMATCH, _foreign(payload, exc, report)) from None
        if isinstance(msg, ErrorMessage):
            raise _Stop(Exit.PROTOCOL_MISMATCH, f"the prefill refused our message: {msg.reason}")
        if not isinstance(msg, Ping):
            return msg


def _foreign(payload: bytes, exc: ProtocolError, report: ProbeReport) -> str:
    """Why a frame we cannot decode is not ours: another version of the protocol, or no pdxfer at all."""
    try:
        env = msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 — not msgpack at all: the generic sentence below
        env = None
    if isinstance(env, dict) and env.get("p") == CONTROL.name and env.get("v") != VERSION:
        report.protocol = env.get("v") if isinstance(env.get("v"), int) else None
        said = env.get("b", {}).get("reason") if isinstance(env.get("b"), dict) else None
        return (f"the prefill speaks pdxfer-ctl version {env.get('v')!r}, this probe {VERSION}: "
                "run the same pdxfer version on both sides" + (f" (it said: {said})" if said else ""))
    return f"not a pdxfer prefill's control port: {exc}"


def load_layout(spec: str) -> dict[str, Any]:
    """The pools `MODULE:FUNCTION` returns (`{pool name: arena}`), or `ValueError` saying why not."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--layout {spec!r}: give MODULE:FUNCTION, e.g. mypkg.caches:probe_pools")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--layout {spec!r}: cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--layout {spec!r}: {module_name} has no function {attr!r}")
    pools = fn()
    if not isinstance(pools, Mapping) or not pools:
        raise ValueError(f"--layout {spec!r} returned {type(pools).__name__}, not a non-empty "
                         "mapping of pool name -> arena")
    return dict(pools)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdxfer probe", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="dial a prefill's control port as a decode would: who answers, whether its "
                    "pools match a local declaration (every difference named), and a checked "
                    "write over the data path",
        epilog="exit status: " + ", ".join(f"{int(e)} {e.name.lower().replace('_', ' ')}"
                                           for e in Exit))
    parser.add_argument("address", help="the prefill's bootstrap address, HOST:PORT")
    parser.add_argument("--layout", required=True, metavar="MODULE:FUNCTION",
                        help="a function returning this decode's pools {name: arena}; entry "
                             "counts are not compared, so a few entries per pool do")
    parser.add_argument("--transport", default="tcp", help="the data transport (default tcp)")
    parser.add_argument("--host", help="address the prefill dials back for the data path "
                                       "(default: this host's address toward the prefill)")
    parser.add_argument("--timeout", type=positive_float, default=5.0,
                        help="seconds the whole probe may take (default 5)")
    parser.add_argument("--bytes", type=byte_size, default=1 << 20, dest="nbytes",
                        help=f"size of the bandwidth echo, at most {MAX_ECHO >> 20}MiB (default 1MiB)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer probe`: print the report; the exit status says the cause."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        parse_address(args.address)
    except RequestError as exc:
        parser.error(str(exc))
    if args.nbytes > MAX_ECHO:
        parser.error(f"--bytes {args.nbytes}: at most {MAX_ECHO} ({MAX_ECHO >> 20}MiB)")
    if args.transport not in transports.known():
        parser.error(f"--transport {args.transport!r}: unknown; known: {', '.join(transports.known())}")
    why = transports.why_unavailable(args.transport)
    if why is not None:
        parser.error(f"--transport {args.transport}: not usable on this host: {why}")
    try:
        pools = load_layout(args.layout)
    except ValueError as exc:
        parser.error(str(exc))
    report = probe(args.address, pools, transport=args.transport, host=args.host,
                   timeout=args.timeout, echo_bytes=args.nbytes)
    if args.json:
        json.dump(asdict(report), sys.stdout, indent=1)
        print()
    else:
        print(report.text())
    return report.exit_code
