"""Many transport engines in one process, for a test that freezes them all at once.

Run as `python tests/transport/many_peers.py BACKEND COUNT`: creates COUNT
engines of BACKEND (connect_timeout 5 s), registers a 64 KiB buffer on each,
prints one line — hex of msgpack `[{"address": ..., "descriptor": ...}, ...]`
— and serves until its stdin closes. SIGSTOPping this one process stalls
every one of them: their sockets stay open and nobody reads them.
"""

from __future__ import annotations

import sys

import msgpack
import torch

from pdxfer import transport


def main(backend: str, count: int) -> None:
    engines = [transport.create(backend, connect_timeout=5.0) for _ in range(count)]
    info = []
    for engine in engines:
        region = engine.register(torch.zeros(64 << 10, dtype=torch.uint8))
        info.append({"address": engine.address(), "descriptor": region.descriptor()})
    print(msgpack.packb(info).hex(), flush=True)
    sys.stdin.read()
    for engine in engines:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
