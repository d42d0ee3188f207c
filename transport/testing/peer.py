"""A transport engine in a process of its own, for kit cases that kill or freeze a peer.

Run as `python -m pdxfer.transport.testing.peer NAME OPTIONS NBYTES`
(`OPTIONS`: the hex of msgpack of the keyword options): creates
`transport.create(NAME, **OPTIONS)`, registers a zeroed NBYTES buffer,
prints one line — hex of msgpack `{"address": ..., "descriptor": ...}` —
and then serves until its stdin closes (or until the test kills it).
"""

from __future__ import annotations

import sys

import msgpack
import torch

from .. import registry


def main(name: str, options: dict, nbytes: int) -> None:
    with registry.create(name, **options) as engine:
        region = engine.register(torch.zeros(nbytes, dtype=torch.uint8))
        info = {"address": engine.address(), "descriptor": region.descriptor()}
        print(msgpack.packb(info).hex(), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], msgpack.unpackb(bytes.fromhex(sys.argv[2])), int(sys.argv[3]))
