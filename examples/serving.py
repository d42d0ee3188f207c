"""What the two example workers share: options, the readiness line, the run loop.

A worker is started either as its own process (`python -m examples.prefill_worker`,
`python -m examples.decode_worker`, possibly on two machines) or, for a
transport that cannot span processes, as threads inside the launcher. Both
ways construct the worker from one frozen `WorkerOptions`, so the command line
is only a way of filling it in.

A worker tells whoever started it that it is serving by printing ONE line to
stdout, `READY_PREFIX` followed by a JSON object (role, RPC address, pid and,
for prefill, the pdxfer bootstrap address; with `--metrics-port`, the
`metrics` address Prometheus scrapes); everything else a worker says goes
to stderr. Port 0 is the default everywhere, so the readiness line is how a
launcher learns the ports the kernel picked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdxfer.transport.errors import TransferTimeout

from pdxfer import EngineConfig, RequestError, RequestFailed, observe, transport
from pdxfer.cliargs import bounded_int, check_ports_free, device_name, positive_float

from . import startup
from .caches import PoolSizes

READY_PREFIX = "PDXFER_EXAMPLE_READY "
PORT = bounded_int(0, 65535)


@dataclass(frozen=True)
class WorkerOptions:
    """Everything a worker is configured with; read by both worker kinds."""

    host: str = "127.0.0.1"  # where the worker's RPC listener binds
    port: int = 0
    transport: str = "tcp"
    device: str = "cpu"
    sizes: PoolSizes = PoolSizes()
    timeout: float = 10.0  # the pdxfer engine timeout; RPC waits are derived from it
    bootstrap_port: int = 0  # prefill only: the pdxfer control listener
    data_port: int = 0  # the transport's own listener (tcp: where peers push bytes)
    verbose: bool = False
    # Elastic pools (`examples.elastic`): move the kv/state boundary every this many
    # requests (0: kv and state are separate arenas), by this many slots.
    resize_every: int = 0
    resize_step: int = 4
    # Serve the engine's Prometheus series on this port (0: a free one); None: not served.
    metrics_port: int | None = None
    # Stream the kv pages in this many groups of attention layers while the prefill computes
    # (`PrefillEngine.send(layers=)`; kv pages layer-interleaved on both sides); 0: whole entries.
    layer_groups: int = 0

    def engine_config(self) -> EngineConfig:
        # Only a chosen port is passed on: port 0 is every backend's default,
        # and a backend without a listener of its own may not take the option.
        options = {"port": self.data_port} if self.data_port else {}
        return EngineConfig(
            transport=self.transport, host=self.host, port=self.bootstrap_port,
            timeout=self.timeout, transport_options=options,
            # asked for: required (a clear error without prometheus_client); else as installed
            metrics=True if self.metrics_port is not None else None,
        )

    @property
    def rpc_timeout(self) -> float:
        """How long a worker waits for its peer's reply to one request.

        Longer than the engine timeout on purpose: the engine notices a dead
        or stalled transfer itself within `timeout`; this only bounds a peer
        that is alive on the socket but never answers.
        """
        return 3 * self.timeout


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The options both workers accept."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind the RPC (and, for prefill, pdxfer) listeners to")
    parser.add_argument("--port", type=PORT, default=0, help="RPC port; 0 picks a free one")
    parser.add_argument("--transport", default="tcp", help="pdxfer transport backend")
    parser.add_argument("--device", type=device_name, default="auto",
                        help="cpu, cuda, or auto (cuda if present)")
    parser.add_argument("--kv-pages", type=bounded_int(1), default=PoolSizes.kv_pages,
                        help="pages in the paged-KV pool")
    parser.add_argument("--state-entries", type=bounded_int(1), default=PoolSizes.state_entries,
                        help="entries in the per-request state and aux pools")
    parser.add_argument("--data-port", type=PORT, default=0,
                        help="port of the transport's data listener (tcp: the decode side's "
                        "is where prefill pushes cache bytes); 0 picks a free one")
    parser.add_argument("--timeout", type=positive_float, default=10.0,
                        help="seconds before a silent peer fails a request")
    parser.add_argument("--verbose", action="store_true", help="log each request to stderr")
    parser.add_argument("--metrics-port", type=PORT, default=None,
                        help="serve the engine's Prometheus series at http://HOST:PORT/metrics "
                        "(0 picks a free port, named in the readiness line); needs "
                        "prometheus_client (pip install 'pdxfer[metrics]'); default: not served")
    add_resize_args(parser)
    add_stream_args(parser)
    parser.add_argument("--die-with-parent", action="store_true",
                        help="exit when stdin closes (the launcher uses this so that no "
                        "worker outlives it, however it ends)")


def add_resize_args(parser: argparse.ArgumentParser) -> None:
    """`--resize-every`/`--resize-step`, the same words for the launcher and both workers."""
    parser.add_argument("--resize-every", type=bounded_int(0), default=0, metavar="N",
                        help="keep kv pages and states in one allocation and move their boundary "
                        "every N requests (state pool grows, then shrinks back); 0: off")
    parser.add_argument("--resize-step", type=bounded_int(1), default=WorkerOptions.resize_step,
                        metavar="SLOTS", help="slots the boundary moves by (with --resize-every)")


def add_stream_args(parser: argparse.ArgumentParser) -> None:
    """`--layer-groups`, the same words for the launcher and both workers."""
    parser.add_argument("--layer-groups", type=bounded_int(0), default=0, metavar="N",
                        help="stream each request's kv pages in N groups of attention layers "
                        "while the prefill computes the rest (capped at the model's layers; "
                        "kv pages layer-interleaved on both sides); 0: send whole entries")


def check_stream_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse `--layer-groups` with `--resize-every`: an elastic kv pool is entry-major."""
    if args.layer_groups and args.resize_every:
        parser.error("--layer-groups needs layer-interleaved kv pages, and --resize-every "
                     "keeps kv in an entry-major elastic allocation; use one of them")


def parse_worker_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse a worker's command line, refusing a fixed port that is taken by its flag's name."""
    args = parser.parse_args(argv)
    check_transport(parser, args.transport)
    if args.metrics_port is not None and not observe.metrics_available():
        parser.error("--metrics-port needs prometheus_client, which is not installed here; "
                     "pip install 'pdxfer[metrics]' (or drop --metrics-port)")
    check_stream_args(parser, args)
    check_ports_free(parser, args.host, {
        "--port": args.port, "--bootstrap-port": getattr(args, "bootstrap_port", 0),
        "--data-port": args.data_port, "--metrics-port": args.metrics_port or 0,
    })
    return args


def installed_transports() -> list[str]:
    """Every backend and named variant (`nixl-all`, `ucx-all`) that imports here."""
    return transport.available() + transport.variants()


def check_transport(parser: argparse.ArgumentParser, name: str) -> None:
    """`parser.error` unless `name` is an installed backend or variant."""
    if name not in installed_transports():
        parser.error(f"transport {name!r} is not installed here; "
                     f"choose one of {', '.join(installed_transports())}")


def cross_process(name: str) -> bool:
    """Whether backend `name` connects separate processes (asked, not guessed)."""
    return transport.capabilities(name).cross_process


def options_from_args(args: argparse.Namespace, device: str) -> WorkerOptions:
    """Options from a worker's command line; refuses a transport that cannot cross processes."""
    if not cross_process(args.transport):
        raise SystemExit(
            f"error: transport {args.transport!r} cannot connect two processes, so a worker "
            f"process cannot use it; `python -m examples.launch_pd --transport {args.transport}` "
            "runs both workers in one process instead"
        )
    return WorkerOptions(
        host=args.host, port=args.port, transport=args.transport, device=device,
        sizes=PoolSizes(kv_pages=args.kv_pages, state_entries=args.state_entries),
        timeout=args.timeout, bootstrap_port=getattr(args, "bootstrap_port", 0),
        data_port=args.data_port, verbose=args.verbose, resize_every=args.resize_every,
        resize_step=args.resize_step, metrics_port=args.metrics_port,
        layer_groups=args.layer_groups,
    )


def serve_metrics(opts: WorkerOptions, engine: Any) -> tuple[Any, str] | None:
    """Serve `engine`'s series if `--metrics-port` asked for it: (server, "host:port"), else None."""
    if opts.metrics_port is None:
        return None
    server, port = observe.serve_metrics(engine.metrics, opts.metrics_port, opts.host)
    return server, f"{opts.host}:{port}"


def stop_metrics(served: tuple[Any, str] | None) -> None:
    """Stop what `serve_metrics` started (idempotent: None does nothing)."""
    if served is not None:
        served[0].shutdown()
        served[0].server_close()


def logger(role: str, verbose: bool) -> Callable[[str], None]:
    """A stderr logger; `verbose=False` keeps only lines marked as errors."""

    def log(message: str, *, error: bool = False) -> None:
        if verbose or error:
            print(f"[{role} {os.getpid()}] {message}", file=sys.stderr, flush=True)

    return log


def announce_ready(info: dict[str, Any]) -> None:
    """The one stdout line a launcher waits for."""
    print(READY_PREFIX + json.dumps(info, sort_keys=True), flush=True)


def parse_ready(line: str) -> dict[str, Any] | None:
    """The readiness info in `line`, or None if it is not the readiness line."""
    if not line.startswith(READY_PREFIX):
        return None
    return json.loads(line[len(READY_PREFIX):])


class StopSignals:
    """SIGINT and SIGTERM as ONE `KeyboardInterrupt`; every later one is only counted.

    Installed first thing in a worker's `main`, before the model is built, so
    no signal finds Python's default handler. Ctrl-C in a terminal reaches
    the launcher and both workers at once, and the launcher then SIGTERMs
    each worker: a second signal landing while the worker builds its closer
    thread used to raise a second `KeyboardInterrupt` there, print its
    traceback and skip `close()` (`terminate called without an active
    exception` when a native thread was then torn down). Raising once makes
    stopping idempotent: the first signal unwinds to the `finally` that
    closes, and the rest find the worker already stopping.
    """

    def __init__(self) -> None:
        self.stopping = False
        self.extra = 0
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        # Put back on exit: a worker's main() is also called in-process (tests).
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stopping and startup.is_program():
            # The process is ending. A signal still on its way (the rest of a burst, the
            # launcher's SIGTERM after a Ctrl-C) would meet SIG_DFL during interpreter
            # shutdown, which takes a while with torch loaded, and turn exit 0 into -15:
            # keep only counting until the process is gone.
            return
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopping:
            self.extra += 1
            return
        self.stopping = True
        raise KeyboardInterrupt

    def disarm(self) -> None:
        """From here on a signal only counts: the caller is closing already."""
        self.stopping = True


def serve_until_signalled(serve: Callable[[], None], close: Callable[[], None],
                          die_with_parent: bool = False,
                          signals: StopSignals | None = None,
                          ready_info: dict[str, Any] | None = None) -> int:
    """Run `serve` in this (main) thread until SIGTERM/SIGINT, then `close`.

    SIGTERM is turned into a clean exit so the pdxfer engine and the sockets
    are closed by their own `close()` rather than by the kernel. With
    `die_with_parent`, stdin reaching EOF counts as a SIGTERM: a launcher
    holds the write end, and the kernel closes it however the launcher dies
    (SIGKILL included), which no signal handler of the launcher could promise.
    `signals` is the `StopSignals` the caller installed before building what
    `serve` runs (one is installed here otherwise). `ready_info` is announced
    (`announce_ready`) inside the same `try`, so a signal that arrives as the
    launcher reads the line still ends in `close`.
    """
    if signals is None:
        with StopSignals() as signals:
            return serve_until_signalled(serve, close, die_with_parent, signals, ready_info)
    if die_with_parent:
        def watch() -> None:
            # The raw fd, not sys.stdin: a daemon thread parked inside a
            # buffered reader's lock aborts interpreter shutdown.
            while os.read(0, 4096):
                pass
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    try:
        if ready_info is not None:
            announce_ready(ready_info)
        if not signals.stopping:  # a signal during start-up: straight to close
            serve()
    except KeyboardInterrupt:
        pass
    finally:
        signals.disarm()
        # close() in a thread of its own, so that no signal handler runs inside it.
        closer = threading.Thread(target=close, name="closer")
        closer.start()
        closer.join()
    return 0


def check_prompt(prompt: object, vocab: int) -> list[int]:
    """A request's prompt as token ids, or ValueError naming what is wrong."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r:.60}")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt holds {len(bad)} token(s) outside 0..{vocab - 1}, e.g. {bad[0]!r}")
    return list(prompt)


def abort_and_release(engine: Any, request_id: str, reason: str, timeout: float) -> bool:
    """Abort a request and forget it once the engine has fenced it.

    The engine finishes an aborted request asynchronously (it tells the peer
    and waits for its ack, or fences it), and only then may the request's
    entries be written by anyone else. Returns False when that did not happen
    within `timeout`: the caller must then NOT reuse the entries, because
    bytes of the aborted transfer could still land in them.
    """
    try:
        engine.abort(request_id, reason)
    except RequestError:
        return True  # the engine never took it: nothing can land
    try:
        engine.wait(request_id, timeout=timeout)
    except RequestFailed:
        pass
    except TransferTimeout:
        return False
    engine.release(request_id)
    return True
