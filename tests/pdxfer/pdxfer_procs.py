"""Prefill and decode engines in their own processes, stepped one stdin line at a time.

The SIGKILL/SIGSTOP tests need the peer to be another process: its death is
then an OS-level event (sockets reset by the kernel, no goodbye) and a stall
is a process that is alive but silent. `prefill_proc.py`/`decode_proc.py`
are the processes; these are the test's handles on them. Each is forked from
a server that imported torch and pdxfer once (`transport.testing.forked`:
why that is still a process of its own in every way these tests use).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdxfer.transport.testing.forked import ForkedProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class Proc:
    """A helper process answering one line per command."""

    def __init__(self, script: str, *args: str, stderr: Any = None) -> None:
        """`stderr`: a file for the process's log (default: the test's own stderr)."""
        self.proc = ForkedProcess(script=str(HERE / script), args=args, paths=[str(ROOT), str(HERE)],
                                  cwd=str(ROOT), stderr=stderr)
        word, self.address = self.line().split()
        assert word == "READY"

    def line(self) -> str:
        out = self.proc.stdout.readline()
        if not out:
            raise AssertionError(f"helper process exited with {self.proc.wait(5)}")
        return out.strip()

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the process is stopped."""
        self.proc.freeze()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values)) or "-"


class Prefill(Proc):
    """`prefill_proc.py`: `address` is its bootstrap address."""

    def __init__(self, backend: str, port: int = 0, timeout: float = 2.0, *extra: str,
                 stderr: Any = None) -> None:
        """`extra`: more `prefill_proc.py` options (`--kind layer`, `--entries`, `--grace`, `--fence off`)."""
        super().__init__("prefill_proc.py", "--transport", backend, "--port", str(port),
                         "--timeout", str(timeout), *extra, stderr=stderr)

    def send(self, rid: str, kv: list[int], state: list[int]) -> None:
        assert self.ask(f"send {rid} {_csv(kv)} {_csv(state)}") == f"SENT {rid}"

    def stream(self, rid: str, kv: list[int], layers: tuple[int, int]) -> None:
        assert self.ask(f"stream {rid} {_csv(kv)} {layers[0]} {layers[1]}") == f"SENT {rid}"

    def wait(self, rid: str) -> str:
        return self.ask(f"wait {rid}")

    def until(self, rid: str, state: str) -> str:
        return self.ask(f"until {rid} {state}")


class Decode(Proc):
    """`decode_proc.py`: `address` is its transport engine id."""

    def __init__(self, backend: str, timeout: float = 2.0) -> None:
        super().__init__("decode_proc.py", "--transport", backend, "--timeout", str(timeout))

    def expect(self, rid: str, prefill: str, kv: list[int], state: list[int]) -> None:
        assert self.ask(f"expect {rid} {prefill} {_csv(kv)} {_csv(state)}") == f"EXPECTING {rid}"

    def wait(self, rid: str) -> str:
        return self.ask(f"wait {rid}")


def warm_up(decode, prefill: Prefill, dst: Callable[[int], int], src: int, wait: float) -> None:
    """Bring `decode`'s links to the `prefill` process up with one small transfer that succeeds.

    The decode's request wait also bounds its first handshake, which a loaded
    machine can outlast: a later try reuses the link (up to 10 tries).
    `dst(attempt)`: the destination kv entry of try `attempt` (a failed try may
    still hold its own); `src`: the prefill's source entry.
    """
    from pdxfer import KVPoll, RequestFailed

    for attempt in range(10):
        rid = f"warm{attempt}"
        decode.expect(rid, prefill.address, {"kv": [dst(attempt)]})
        prefill.send(rid, [src], [])
        try:
            if decode.wait(rid, wait) is KVPoll.Success:
                return
        except RequestFailed:
            continue
    raise AssertionError("no warm-up request succeeded in 10 tries")
