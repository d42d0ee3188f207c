"""A ucx engine that sends one big write from a process of its own (test_ucx's fence test).

Run as `python ucx_sender.py NBYTES`; reads one line from stdin — hex of
msgpack `{"address": ..., "descriptor": ...}` of the receiving engine and
region — then prints `engine <id>`, connects, prints `connected`, waits
for a line `go`, posts one write of NBYTES (bytes 0xAB) and prints `done`
or `failed <error class>` when its handle ends, and waits for stdin to close.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, not imported: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdxfer import transport  # noqa: E402


def main(nbytes: int) -> None:
    peer = msgpack.unpackb(bytes.fromhex(sys.stdin.readline().strip()))
    with transport.create("ucx") as engine:
        src = engine.register(torch.full((nbytes,), 0xAB, dtype=torch.uint8))
        print("engine", engine.engine_id, flush=True)
        conn = engine.connect(peer["address"])
        print("connected", flush=True)
        sys.stdin.readline()  # "go": the test has set up its side of the link
        handle = conn.write(src, peer["descriptor"], np.array([[0, 0, nbytes]], np.int64), notify=b"late")
        try:
            handle.wait(60)
            print("done", flush=True)
        except transport.TransportError as exc:
            print("failed", type(exc).__name__, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(int(sys.argv[1]))
