"""The receiving side of `pdxfer bench transport`, in this process or in a child process.

Every method the benchmark measures writes into one destination buffer that
a `Receiver` owns: an engine of each backend registered on it, a plain socket
that reads into it, a raw NIXL agent that registers it. With `--processes 1`
the benchmark calls a `Receiver` directly (`LocalPeer`); with `--processes 2`
the same `Receiver` runs in a child process started by `ChildPeer`, so the
prefill-side and decode-side Python share no GIL, as deployed.

Why a child speaking length-prefixed msgpack on a pipe (its stdin and a
duplicate of its original stdout; fd 1 itself is pointed at stderr so a
library that prints cannot corrupt the channel): the operations are few
and small, every one is answered, and each answer is awaited with a
timeout, so a child that dies or stalls ends the benchmark with its exit
status instead of hanging it. Never pickle (the project's wire rule).

An operation is a name and keyword arguments; `start` posts one whose
answer comes after the sender's bytes have landed (a receive loop, a NIXL
notification), `call` posts one and waits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from pdxfer import transport

from ..cliargs import host_port, listen_address

_LEN = struct.Struct("<I")
# What a legend says of `--processes 2`, in every bench that has it.
CHILD_NOTE = "; receiving side in a child process (where the backend can cross processes)"
_MAX_FRAME = 64 << 20  # a table of 65,536 rows is 1.5 MiB; anything near this is a bug
NIXL_WAIT_S = 120.0


def crosses_processes(backend: str) -> bool:
    """Whether `backend`'s peers may live in another process (its capability flag)."""
    return transport.capabilities(backend).cross_process


class Receiver:
    """The destination buffer and every endpoint that writes into it (one per method)."""

    def __init__(self, total: int, host: str = "127.0.0.1") -> None:
        # `host`: the address every endpoint here listens on (the one the
        # sender reached, in the two-host mode; loopback otherwise).
        self.host = host
        self.dst = np.zeros(total, dtype=np.uint8)
        self._engines: list[Any] = []
        self._server: socket.socket | None = None
        self._sock: socket.socket | None = None
        self._rows: list[list[int]] = []
        self._agents: dict[str, Any] = {}

    # -- verification ---------------------------------------------------------
    def zero(self) -> None:
        self.dst[:] = 0

    def crc(self, size: int | None = None) -> int:
        return zlib.crc32(self.dst[:size])

    # -- engines --------------------------------------------------------------
    def engine(self, backend: str, options: dict[str, Any]) -> dict[str, Any]:
        """A `backend` engine with the buffer registered: its address and the region's descriptor."""
        eng = transport.create(backend, host=self.host, **options)
        self._engines.append(eng)
        region = eng.register(torch.from_numpy(self.dst))
        return {"address": eng.address(), "descriptor": region.descriptor()}

    # -- a plain socket ---------------------------------------------------------
    def raw_listen(self) -> list:
        """The plain socket's `[host, port]`, listening."""
        self._server = socket.create_server((self.host, 0))
        return [self.host, self._server.getsockname()[1]]

    def raw_accept(self) -> None:
        assert self._server is not None
        self._server.settimeout(30)
        self._sock, _ = self._server.accept()
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(120)

    def raw_table(self, table: bytes) -> None:
        self._rows = np.frombuffer(table, dtype="<i8").reshape(-1, 3).tolist()

    def raw_recv(self) -> None:
        """One `recv_into` loop per segment of the current table, as a naive transport does."""
        assert self._sock is not None
        view = memoryview(self.dst)
        for _, d, n in self._rows:
            got = 0
            while got < n:
                k = self._sock.recv_into(view[d + got:d + n])
                if k == 0:
                    raise ConnectionError("raw socket pair: the sender closed")
                got += k

    # -- raw NIXL ----------------------------------------------------------------
    def nixl(self, name: str, tls: str, device: str = "") -> dict[str, Any]:
        """A plain NIXL agent (NIXL's defaults; UCX transports `tls`, '' = UCX's own choice)."""
        from .rawnixl import agent

        a = agent(name, tls, device)
        a.register_memory(torch.from_numpy(self.dst))
        self._agents[name] = a
        return {"metadata": a.get_agent_metadata(), "base": self.dst.ctypes.data}

    def nixl_wait(self, name: str, sender: str, tag: bytes) -> None:
        """Return once the notification `tag` from `sender` arrived (NIXL sends it after the data)."""
        a = self._agents[name]
        deadline = time.monotonic() + NIXL_WAIT_S
        while not a.check_remote_xfer_done(sender, tag):
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL: no notification {tag!r} within {NIXL_WAIT_S} s")
            time.sleep(20e-6)

    def close(self) -> None:
        for eng in self._engines:
            eng.close()
        self._engines.clear()
        for s in (self._sock, self._server):
            if s is not None:
                s.close()
        self._agents.clear()


OPS = ("zero", "crc", "engine", "raw_listen", "raw_accept", "raw_table", "raw_recv", "nixl", "nixl_wait")


class LocalPeer:
    """A `Receiver` in this process: `start`ed operations run on a thread."""

    def __init__(self, total: int) -> None:
        self.receiver = Receiver(total)
        self.dst = self.receiver.dst

    def call(self, op: str, **kw: Any) -> Any:
        return getattr(self.receiver, op)(**kw)

    def start(self, op: str, **kw: Any) -> Callable[[], Any]:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = self.call(op, **kw)
            except BaseException as exc:  # handed to finish(), which raises it
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"bench-{op}")
        thread.start()

        def finish() -> Any:
            thread.join(NIXL_WAIT_S + 10)
            if thread.is_alive():
                raise SystemExit(f"bench peer: {op} did not finish within {NIXL_WAIT_S + 10} s")
            if "error" in box:
                raise box["error"]
            return box.get("value")

        return finish

    def close(self) -> None:
        self.receiver.close()


def _write(fd: int, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    os.write(fd, _LEN.pack(len(body)) + body)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("bench peer did not answer in time")
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("bench peer closed its channel")
        out += chunk
    return bytes(out)


def _read(fd: int, deadline: float | None) -> Any:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    if n > _MAX_FRAME:
        raise ValueError(f"bench peer frame of {n} B exceeds {_MAX_FRAME} B")
    return msgpack.unpackb(_read_exact(fd, n, deadline), raw=False, strict_map_key=True)


class ChildPeer:
    """A `Receiver` in a child process (spawned interpreter), driven over a msgpack pipe."""

    def __init__(self, total: int, timeout: float = NIXL_WAIT_S + 30,
                 module: str = "pdxfer.bench.peer") -> None:
        self.timeout = timeout
        self.dst = None  # lives in the child
        # `module` runs `serve` with its own receiver class (decode_peer: a DecodeEngine).
        # Its own session: a terminal's Ctrl-C reaches only the bench, which says how far
        # it got and closes the child (`quit`, or end of file on its pipe); in the
        # terminal's process group the child printed a KeyboardInterrupt traceback.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(total)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        self._busy = False
        self._rfd, self._wfd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        try:
            self.call("ping")  # the child is up and its receiver exists
        except BaseException:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def _send(self, op: str, kw: dict[str, Any]) -> None:
        if self._busy:
            raise RuntimeError("bench peer: one operation at a time")
        self._busy = True
        _write(self._wfd, {"op": op, "kw": kw})

    def _answer(self) -> Any:
        try:
            reply = _read(self._rfd, time.monotonic() + self.timeout)
        except (TimeoutError, EOFError, OSError) as exc:
            raise SystemExit(f"{self._who} failed ({exc}{self._status()})") from exc
        finally:
            self._busy = False
        if "error" in reply:
            raise SystemExit(f"{self._who}: {reply['error']}")
        return reply.get("value")

    _who = "bench peer process"

    def _status(self) -> str:
        return f"; exit status {self.proc.poll()}"

    def call(self, op: str, **kw: Any) -> Any:
        self._send(op, kw)
        return self._answer()

    def start(self, op: str, **kw: Any) -> Callable[[], Any]:
        self._send(op, kw)
        return self._answer

    def close(self) -> None:
        """Ask the child to close everything and exit; kill it if it does not within the timeout."""
        if self.proc.poll() is None:
            try:
                _write(self.proc.stdin.fileno(), {"op": "quit", "kw": {}})
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


def serve(receiver: Any, ops: tuple[str, ...] = OPS) -> int:
    """The child's loop: answer operations until `quit` or the parent's end of the pipe closes."""
    out = os.dup(1)
    os.dup2(2, 1)  # stray prints (UCX, NIXL) go to stderr, never into the channel
    try:
        return _loop(receiver, ops, 0, out)
    finally:
        receiver.close()


def _loop(receiver: Any, ops: tuple[str, ...], rfd: int, wfd: int) -> int:
    """Answer operations read from `rfd` on `wfd` until `quit` or end of file; 0."""
    while True:
        try:
            msg = _read(rfd, None)
        except EOFError:
            return 0
        op, kw = msg.get("op"), msg.get("kw")
        if op == "quit":
            return 0
        if op == "ping":
            _write(wfd, {"value": None})
            continue
        if op not in ops or not isinstance(kw, dict):
            _write(wfd, {"error": f"unknown operation {op!r}"})
            continue
        try:
            _write(wfd, {"value": getattr(receiver, op)(**kw)})
        except Exception as exc:  # reported to the other side, which stops the benchmark
            _write(wfd, {"error": f"{op}: {type(exc).__name__}: {exc}"})


# -- two hosts ------------------------------------------------------------------
# `pdxfer bench transport|engine --listen PORT` on one host and `--connect
# HOST:PORT` on the other: the listener is the receiving side (the same
# `Receiver`, or `decode_peer.DecodeSide`), driven over one TCP connection
# speaking the child's protocol; the connecting side measures and prints.

# How long a listener waits for the other host's `--connect`, and how long a
# connect waits for the listener to answer its hello (it may be starting).
LISTEN_WAIT_S = 600.0
HELLO_WAIT_S = 30.0


class MismatchError(Exception):
    """The two hosts run different commands (sizes, backends): the run cannot be compared."""


def _mismatch(bench: str, mine: dict[str, Any], theirs: Any) -> str | None:
    """Why the other side's hello does not match this run, or None."""
    if not isinstance(theirs, dict) or theirs.get("bench") != bench:
        got = theirs.get("bench") if isinstance(theirs, dict) else None
        return f"the other host runs `pdxfer bench {got}`, this one `pdxfer bench {bench}`"
    differ = sorted(k for k in set(mine) | set(theirs.get("params", {}))
                    if mine.get(k) != theirs["params"].get(k))
    if differ:
        k = differ[0]
        return (f"the two hosts run different commands: {k} is {mine.get(k)!r} on the "
                f"--listen host and {theirs['params'].get(k)!r} on the --connect host; run the "
                "same command on both (only --listen / --connect differ)")
    return None


def listen(host: str, port: int, bench: str, params: dict[str, Any],
           make: Callable[[str], Any], ops: tuple[str, ...],
           log: Callable[[str], None], wait_s: float = LISTEN_WAIT_S) -> int:
    """Serve one `--connect` run as its receiving side; 0 when it ends, 2 on a mismatch.

    `make(address)` builds the receiver once the hello matched, `address`
    being this host's address as the other host reached it (every endpoint
    the receiver opens listens there).
    """
    with socket.create_server((host, port)) as server:
        bound = server.getsockname()
        log(f"# listening on {bound[0]}:{bound[1]}: run the same command with "
            f"--connect THIS_HOST:{bound[1]} on the other host (waiting up to {wait_s:.0f} s)")
        server.settimeout(wait_s)
        try:
            conn, peer = server.accept()
        except TimeoutError:
            raise SystemExit(f"error: no --connect reached {bound[0]}:{bound[1]} within "
                             f"{wait_s:.0f} s") from None
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fd = conn.fileno()
        hello = _read(fd, time.monotonic() + HELLO_WAIT_S)
        why = _mismatch(bench, params, hello.get("kw") if hello.get("op") == "hello" else None)
        if why is not None:
            _write(fd, {"error": why})
            log(f"error: {why}")
            return 2
        here = conn.getsockname()[0]
        receiver = make(here)
        try:
            _write(fd, {"value": {"host": here}})
            log(f"# {peer[0]} connected; receiving at {here}")
            code = _loop(receiver, ops, fd, fd)
        except (EOFError, OSError) as exc:
            raise SystemExit(f"error: the connection from {peer[0]} broke ({exc})") from None
        finally:
            receiver.close()
        log(f"# the run from {peer[0]} finished")
        return code


def add_two_host_args(parser: argparse.ArgumentParser) -> None:
    """`--listen [HOST:]PORT` / `--connect HOST:PORT`, the same words in every bench that has them."""
    two = parser.add_mutually_exclusive_group()
    two.add_argument("--listen", type=listen_address, default=None, metavar="[HOST:]PORT",
                     help="two hosts: be the receiving side on PORT (0: any free one) and wait "
                          "for the same command with --connect on the other host, which prints "
                          "the results")
    two.add_argument("--connect", type=host_port, default=None, metavar="HOST:PORT",
                     help="two hosts: measure against the --listen side at HOST:PORT")


def check_two_host_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the two-host mode cannot honour, before anything starts."""
    if args.listen is None and args.connect is None:
        return
    flag = "--listen" if args.listen is not None else "--connect"
    if args.processes != 1:
        parser.error(f"--processes {args.processes} with {flag}: the receiving side is the "
                     "other host already; drop --processes")
    if args.listen is not None:
        for out in ("json", "plot"):
            if getattr(args, out, None) is not None:
                parser.error(f"--{out} with --listen: the results print on the --connect side; "
                             f"pass --{out} there")


def log(line: str) -> None:
    """A status line on stderr (stdout stays the table)."""
    print(line, file=sys.stderr, flush=True)


class NetPeer(ChildPeer):
    """The receiving side on another host (`listen`), with `ChildPeer`'s calls.

    The hello carries this run's bench and parameters; the listener refuses a
    run that does not match its own command line, and `MismatchError` says why.
    """

    _who = "the --listen host"

    def __init__(self, host: str, port: int, bench: str, params: dict[str, Any],
                 timeout: float = NIXL_WAIT_S + 30) -> None:
        self.timeout = timeout
        self.dst = None
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=HELLO_WAIT_S)
        except OSError as exc:
            raise SystemExit(f"error: --connect {self.address}: {exc.strerror or exc}; is "
                             "`pdxfer bench ... --listen` running there?") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)  # every read below has its own deadline
        self._rfd = self._wfd = self.sock.fileno()
        self._busy = False
        #: this host's address as the listener sees it: where our endpoints listen
        self.local = self.sock.getsockname()[0]
        _write(self._wfd, {"op": "hello", "kw": {"bench": bench, "params": params}})
        try:
            reply = _read(self._rfd, time.monotonic() + HELLO_WAIT_S)
        except (TimeoutError, EOFError, OSError) as exc:
            self.sock.close()
            raise SystemExit(f"error: --connect {self.address}: no answer to the hello ({exc})") from None
        if "error" in reply:
            self.sock.close()
            raise MismatchError(reply["error"])
        self.remote = reply["value"]["host"]

    def _status(self) -> str:
        return f"; at {self.address}"

    def close(self) -> None:
        """Tell the listener the run is over (it exits), then close the connection."""
        if self.sock.fileno() < 0:
            return
        with contextlib.suppress(OSError):
            _write(self._wfd, {"op": "quit", "kw": {}})
        self.sock.close()


if __name__ == "__main__":
    sys.exit(serve(Receiver(int(sys.argv[1]))))
