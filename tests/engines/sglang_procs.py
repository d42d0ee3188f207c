"""The SGLang tests' worker processes, stepped line by line (`sglang_prefill_proc`, `sglang_decode_proc`)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a bootstrap server, free now, below the kernel's ephemeral range.

    Not port 0's answer: that is an ephemeral port, which every engine's own
    port-0 bind (pdxfer's control and data listeners, in five processes
    starting at once) may take before the server binds it.
    """
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} below {lo}")


class Proc:
    """A harness process: JSON commands in on stdin, JSON events out on stdout."""

    def __init__(self, script: str, args: list[str], config: dict | None = None) -> None:
        # Not ROOT: a checkout's stale pdxfer.egg-info there would hide the installed entry points.
        env = {**os.environ, "PYTHONPATH": str(HERE)}
        if config is not None:
            env["PDXFER_CONFIG"] = json.dumps(config)
        self.proc = subprocess.Popen([sys.executable, str(HERE / script), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env)

    def read(self) -> dict:
        while True:  # SGLang logs to stdout too: our events are the JSON lines
            line = self.proc.stdout.readline()
            assert line, f"{self.proc.args[1]} exited ({self.proc.wait(30)})"
            if line.startswith("{"):
                return json.loads(line)

    def write(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) if cmd else "go") + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """End of input: the process closes its managers and exits; killed if it cannot."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


class PrefillProc(Proc):
    """One prefill process (`sglang_prefill_proc.py`): TP ranks `ranks` (MHA, hybrid or MLA), its
    own registry or `port`'s."""

    def __init__(self, hybrid: bool = False, *, mla: bool = False, tp: int = 2,
                 ranks: list[int] | None = None,
                 port: int | None = None, config: dict | None = None, dp: int = 1,
                 flags: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        cfg = {"transport": "tcp", "host": "127.0.0.1", "timeout": 2.0, "request_timeout": 30.0}
        cfg = cfg if config is None else {"transport": "tcp", "host": "127.0.0.1", **config}
        hosted = ranks if ranks is not None else list(range(tp))
        super().__init__("sglang_prefill_proc.py",
                         [str(self.port), "mla" if mla else "1" if hybrid else "0", str(tp),
                          ",".join(map(str, hosted)), "0" if port else "1", str(dp),
                          json.dumps(list(flags))], cfg)
