"""A verbs sender in its own process, for the fence test under SIGSTOP.

Run as `python sender_proc.py ADDRESS_HEX DESCRIPTOR_HEX NBYTES`: registers
NBYTES of 0xA5, connects, posts one NBYTES write in rows of 64 MiB, prints
its engine id, then waits for stdin to close (the test freezes or kills it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdxfer import transport  # noqa: E402


def main(address: dict, descriptor: dict, nbytes: int) -> None:
    with transport.create("verbs") as engine:
        region = engine.register(torch.full((nbytes,), 0xA5, dtype=torch.uint8))
        conn = engine.connect(address)
        rows = np.arange(0, nbytes, 64 << 20, dtype=np.int64)
        table = np.stack([rows, rows, np.minimum(64 << 20, nbytes - rows)], 1)
        conn.write(region, descriptor, table)
        print(engine.engine_id, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(msgpack.unpackb(bytes.fromhex(sys.argv[1])), msgpack.unpackb(bytes.fromhex(sys.argv[2])),
         int(sys.argv[3]))
