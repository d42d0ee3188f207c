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

    def __init__(self, total: int) -> None:
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
        eng = transport.create(backend, **options)
        self._engines.append(eng)
        region = eng.register(torch.from_numpy(self.dst))
        return {"address": eng.address(), "descriptor": region.descriptor()}

    # -- a plain socket ---------------------------------------------------------
    def raw_listen(self) -> int:
        self._server = socket.create_server(("127.0.0.1", 0))
        return self._server.getsockname()[1]

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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(total)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self._busy = False
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
        _write(self.proc.stdin.fileno(), {"op": op, "kw": kw})

    def _answer(self) -> Any:
        try:
            reply = _read(self.proc.stdout.fileno(), time.monotonic() + self.timeout)
        except (TimeoutError, EOFError) as exc:
            code = self.proc.poll()
            raise SystemExit(f"bench peer process failed ({exc}; exit status {code})") from exc
        finally:
            self._busy = False
        if "error" in reply:
            raise SystemExit(f"bench peer process: {reply['error']}")
        return reply.get("value")

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
        while True:
            try:
                msg = _read(0, None)
            except EOFError:
                return 0
            op, kw = msg.get("op"), msg.get("kw")
            if op == "quit":
                return 0
            if op == "ping":
                _write(out, {"value": None})
                continue
            if op not in ops or not isinstance(kw, dict):
                _write(out, {"error": f"unknown operation {op!r}"})
                continue
            try:
                _write(out, {"value": getattr(receiver, op)(**kw)})
            except Exception as exc:  # reported to the parent, which stops the benchmark
                _write(out, {"error": f"{op}: {type(exc).__name__}: {exc}"})
    finally:
        receiver.close()


if __name__ == "__main__":
    sys.exit(serve(Receiver(int(sys.argv[1]))))
