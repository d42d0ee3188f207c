"""Starting, watching and stopping the two workers for the launcher.

Two ways to run a worker, one interface (`WorkerHandle`):

- `spawn_worker`: a real child process (`python -m examples.<role>_worker`),
  bound to a port the kernel picks, learnt from the readiness line it prints.
  This is the normal way and the only one that means anything for a
  transport that crosses processes.
- `start_in_process`: the worker object serving from a daemon thread of the
  launcher itself. Only for a transport whose engines cannot span processes
  (`Capabilities.cross_process` is False, e.g. loopback), where two processes
  could not talk at all; the RPC and the pdxfer engines still run exactly as
  they do between processes, they just share an address space.

`stop()` always finishes: SIGTERM, a bounded wait, then SIGKILL. The launcher
calls it for every handle in a `finally` (and turns its own SIGTERM into an
exception so the `finally` runs); should the launcher die without running it,
the workers see their stdin close and exit by themselves (`--die-with-parent`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from .serving import parse_ready

# The checkout that holds `examples/` (not installed; workers run from here).
_CHECKOUT = str(Path(__file__).resolve().parents[1])

_STOP_GRACE_S = 5.0


class WorkerHandle(Protocol):
    info: dict[str, Any]

    def alive(self) -> bool: ...
    def describe_exit(self) -> str: ...
    def kill(self) -> None: ...
    def stop(self) -> None: ...


class WorkerStartError(RuntimeError):
    """A worker died or stayed silent before printing its readiness line."""


class ProcessWorker:
    """A worker child process and its readiness info."""

    def __init__(self, role: str, args: list[str], startup_timeout: float) -> None:
        self.role = role
        cmd = [sys.executable, "-m", f"examples.{role}_worker", *args, "--die-with-parent"]
        # stdout is a pipe only for the readiness line; stderr is inherited so
        # a worker's errors reach whoever runs the launcher. stdin is a pipe we
        # never write: its EOF is how the worker learns this process is gone.
        # `examples` is not an installed package: run the worker from the
        # checkout that holds it, whatever directory the launcher was run from.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, cwd=_CHECKOUT)
        try:
            self.info = self._await_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _await_ready(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(
                    f"{self.role} worker (pid {self.proc.pid}) printed no readiness line "
                    f"within {timeout:.0f} s"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:  # EOF: the worker exited before getting ready
                code = self.proc.wait(timeout=_STOP_GRACE_S)
                raise WorkerStartError(
                    f"{self.role} worker exited with status {code} before it was ready "
                    "(its error is printed above)"
                )
            info = parse_ready(line)
            if info is not None:
                return info

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        """SIGKILL, no goodbye: what a crashed machine looks like to its peer."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL. Always returns; idempotent."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def spawn_worker(role: str, args: list[str], startup_timeout: float) -> ProcessWorker:
    """Start `examples.<role>_worker` with `args` and wait until it serves."""
    return ProcessWorker(role, args, startup_timeout)


class InProcessWorker:
    """A worker object serving from a daemon thread of this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.info = worker.ready_info()
        self._thread = threading.Thread(target=worker.serve_forever, daemon=True,
                                        name=f"{self.info['role']}-worker")
        self._thread.start()
        self._stopped = False

    def alive(self) -> bool:
        return not self._stopped

    def describe_exit(self) -> str:
        return "running" if self.alive() else "stopped"

    def kill(self) -> None:
        raise RuntimeError("an in-process worker cannot be killed; use a cross-process transport")

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.worker.close()
            self._thread.join(timeout=_STOP_GRACE_S)


def start_in_process(worker: Any) -> InProcessWorker:
    """Serve `worker` (a PrefillWorker or DecodeWorker) from a thread."""
    return InProcessWorker(worker)
