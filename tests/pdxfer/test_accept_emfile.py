"""Out of file descriptors, the accepting loops back off instead of spinning (#29 item 2).

An accept that fails with EMFILE leaves the connection queued; a loop that
retries at once — the prefill's level-triggered selector, the transport's
accept thread — then burns a core for as long as the limit lasts (1.33 CPU-s
per 2 s measured before). In a child process whose `RLIMIT_NOFILE` is
exhausted, with a connection queued on both listeners, the process must stay
nearly idle, and both connections must be served once descriptors are free.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from pdxfer.transport.testing.forked import ForkedProcess
from pdxfer_procs import HERE, ROOT

WINDOW = 2.0  # seconds of exhaustion measured
MAX_CPU = 0.25  # CPU-s the process may use in WINDOW (a spinning accept used ~1.3)


class Child:
    def __init__(self) -> None:
        # forked from the preloaded server (transport.testing.forked): seconds less to start
        self.proc = ForkedProcess(script=str(Path(HERE) / "emfile_proc.py"),
                                  paths=[str(ROOT), str(HERE)], cwd=str(ROOT))
        words = self.line().split()
        assert words[0] == "READY", words
        host, port = words[1].rsplit(":", 1)
        self.bootstrap = (host, int(port))
        self.transport = (host, int(words[2]))

    def line(self) -> str:
        out = self.proc.stdout.readline()
        assert out, f"emfile_proc.py exited with {self.proc.wait(10)}"
        return out.strip()

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def cpu(self) -> float:
        word, value = self.ask("cpu").split()
        assert word == "CPU"
        return float(value)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def served(sock: socket.socket, timeout: float) -> bool:
    """Whether the listener took the connection and answered junk by hanging up, within `timeout`."""
    sock.settimeout(timeout)
    try:
        sock.sendall(b"\xff" * 64)  # not a frame of any protocol: the peer must drop us
        while sock.recv(4096):
            pass
        return True  # EOF: accepted, read, dropped
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False  # still queued (or accepted and never read)


def test_exhausted_descriptors_neither_spin_the_accepting_loops_nor_stop_them() -> None:
    child = Child()
    try:
        assert child.ask("exhaust").startswith("HELD ")
        queued = [socket.create_connection(addr, timeout=5) for addr in (child.bootstrap, child.transport)]
        before = child.cpu()
        start = time.monotonic()
        # A measured window of exhaustion, not a synchronisation: both listeners see their
        # queued connection at once (the selector and the accept thread are both awake).
        time.sleep(WINDOW)
        used = child.cpu() - before
        elapsed = time.monotonic() - start
        assert used < MAX_CPU, f"{used:.2f} CPU-s in {elapsed:.1f} s with accepts failing (EMFILE)"
        assert child.ask("free") == "FREED"
        for sock, what in zip(queued, ("prefill bootstrap", "tcp transport"), strict=True):
            assert served(sock, 10.0), f"the {what} listener did not accept once descriptors were free"
            sock.close()
    finally:
        child.close()
