"""Senders that die mid-write, one after another (test_ucx_kill_settles's SIGKILL race).

Run as `python ucx_kill_loop.py TLS KILLS MIB`; reads one line from stdin —
hex of msgpack `{"address": ..., "descriptor": ...}` of the receiving engine
and region. Then, KILLS times: forks a sender (this process has imported
torch and UCXX but made no UCX context, so a fork starts warm), which makes
a ucx engine, connects and keeps writes of MIB MiB in flight; once its first
write was acknowledged it says so, and this process SIGKILLs it after a
short random delay (bytes in flight) and prints `killed <engine id>`.
Prints `done` at the end.
"""

from __future__ import annotations

import os
import random
import select
import signal
import sys
from pathlib import Path

# Run as a script, not imported: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import pdxfer.transport.ucx  # noqa: E402,F401  (UCXX loaded before the forks)
import torch  # noqa: E402

from pdxfer import transport  # noqa: E402


def sender(tls: str, peer: dict, nbytes: int, out: int) -> None:
    engine = transport.create("ucx", tls=tls)
    src = engine.register(torch.full((nbytes,), 0xAB, dtype=torch.uint8))
    conn = engine.connect(peer["address"])
    table = np.array([[0, 0, nbytes]], np.int64)
    conn.write(src, peer["descriptor"], table).wait(30)
    os.write(out, (engine.engine_id + "\n").encode())
    while True:  # killed in here
        handles = [conn.write(src, peer["descriptor"], table, notify=b"n") for _ in range(4)]
        for h in handles:
            h.wait(30)


def main(tls: str, kills: int, mib: int) -> None:
    peer = msgpack.unpackb(bytes.fromhex(sys.stdin.readline().strip()))
    rng = random.Random(356)
    for _ in range(kills):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(r)
                sender(tls, peer, mib << 20, w)
            except BaseException as exc:
                sys.stderr.write(f"sender failed: {type(exc).__name__}: {exc}\n")
                code = 3
            finally:
                os._exit(code)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 60)
        line = os.read(r, 4096).decode().strip() if ready else ""
        os.close(r)
        select.select([], [], [], rng.uniform(0.0, 0.02))  # mid-write
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("killed", line or "?", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
