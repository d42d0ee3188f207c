"""Test peers in processes of their own, forked from a server that imported torch once.

A peer process (the kit's `peer.py`, the engine tests' prefill and decode
processes) exists so that its death or stall is an OS-level event: sockets
reset by the kernel, a process alive but silent. Started as a new
interpreter, each paid ~2.5 CPU-s of imports (torch the bulk) before its
first line, and the suites start dozens. Here each is forked from
multiprocessing's forkserver, started once per test process with those
imports preloaded: the server never built an engine, a thread or a torch
kernel, so a child starts as clean as a spawned one, with its own pid,
engines, sockets and threads, and is killed or stopped by the kernel like
any process. What differs is its parent (the server, not the test), so
`ForkedProcess` keeps Popen's few verbs over `multiprocessing.Process`.

Not for what must be a fresh interpreter: a test of import-time effects
(UCX's environment), of interpreter exit, or of a command as a user types it
(the CLI, the launchers) runs `sys.executable` as before.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

# What every peer imports first. The server takes the list when it starts (the first
# peer of this process); a later, different list would be ignored, so there is one.
PRELOAD = ("numpy", "msgpack", "torch", "pdxfer.transport")


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _child(what: tuple[str, str], args: list[str], paths: list[str], cwd: str | None,
           stdin: Any, stdout: Any, stderr: str | None) -> None:
    """In the forked process: `what` run as `python -m MODULE` / `python SCRIPT` would, on the pipes."""
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    stdin.close()
    stdout.close()
    if stderr is not None:
        fd = os.open(stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    # multiprocessing pointed sys.stdin at /dev/null; the script reads and prints text.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    if cwd is not None:
        os.chdir(cwd)
    kind, name = what
    sys.argv = [name, *args]
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(name, run_name="__main__")
    # a SystemExit from the script ends the process with its code (multiprocessing's rule)


class ForkedProcess:
    """`python -m module args` (or `python script args`) as a forked child, Popen-like.

    `stdin`/`stdout` are pipes to it (text, or bytes with `text=False`);
    `stderr`: a path (or an open file, by its name) its stderr appends to,
    else it shares this process's. `paths` go first on its `sys.path`.
    """

    def __init__(self, *, module: str | None = None, script: str | None = None,
                 args: Sequence[str] = (), paths: Sequence[str] = (), cwd: str | None = None,
                 stderr: Any = None, text: bool = True) -> None:
        if (module is None) == (script is None):
            raise ValueError("give one of module= or script=")
        ctx = _context()
        child_in, to_child = ctx.Pipe(duplex=False)
        from_child, child_out = ctx.Pipe(duplex=False)
        what = ("module", module) if module is not None else ("script", str(script))
        self._process = ctx.Process(target=_child, daemon=True, args=(
            what, list(args), list(paths), cwd, child_in, child_out, getattr(stderr, "name", stderr)))
        self._process.start()
        child_in.close()
        child_out.close()
        # Raw pipes from here on: the Connections' framing is never used.
        mode = "" if text else "b"
        self.stdin = open(os.dup(to_child.fileno()), "w" + mode)  # noqa: SIM115 — closed by wait()
        self.stdout = open(os.dup(from_child.fileno()), "r" + mode)  # noqa: SIM115
        to_child.close()
        from_child.close()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it ended (-N: killed by signal N), as Popen's."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, waiting up to `timeout`; `subprocess.TimeoutExpired` past it."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass  # a buffered write the dead child never read
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """Signal it unless it has ended (as Popen: a process already gone is not an error).

        The server reaps the child and only then reports its status, so for a moment a
        dead child has no exit code here and no pid there: that lookup error is its end.
        """
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def freeze(self, timeout: float = 30.0) -> None:
        """SIGSTOP, returning once every thread of it is stopped (AssertionError past `timeout`).

        The signal is asynchronous: a thread woken by a network event may still
        answer for a moment after `kill` returns. Each thread's state in /proc
        is the event to synchronise on.
        """
        os.kill(self.pid, signal.SIGSTOP)
        tasks = f"/proc/{self.pid}/task"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            try:
                names = os.listdir(tasks)
            except OSError:
                break  # it is gone
            for task in names:
                try:
                    with open(f"{tasks}/{task}/stat") as stat:
                        states.append(stat.read().rsplit(")", 1)[1].split()[0])
                except OSError:
                    continue  # a thread that just ended
            if states and all(st in ("T", "t") for st in states):
                return
            os.sched_yield()
        raise AssertionError(f"process {self.pid} did not stop within {timeout} s")
