"""A transport engine in a process of its own, for tests that kill or freeze a peer.

Run as `python peer_proc.py BACKEND NBYTES`: registers a zeroed NBYTES buffer,
prints one line — hex of msgpack `{"address": ..., "descriptor": ...}` — and
then serves until its stdin closes (or until the test kills it).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, not imported: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import torch  # noqa: E402

from pdxfer import transport  # noqa: E402


def main(backend: str, nbytes: int) -> None:
    with transport.create(backend) as engine:
        region = engine.register(torch.zeros(nbytes, dtype=torch.uint8))
        info = {"address": engine.address(), "descriptor": region.descriptor()}
        print(msgpack.packb(info).hex(), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
