"""A verbs receiver on another host, for the routed-fabric check of the hardware suite.

Run on a host behind at least one router from the one running the suite:
`python tests/hardware/receiver_proc.py HOST [NBYTES]`, with HOST the address of its RoCE
port (the control listener binds it, and the engine takes the GID of that address). It
registers NBYTES (default 1 MiB), prints one line — the hex of its address and the
region's descriptor — and serves until stdin closes. Give that line to the suite as
`PDXFER_VERBS_PEER`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
import torch  # noqa: E402

from pdxfer import transport  # noqa: E402


def main(host: str, nbytes: int) -> None:
    with transport.create("verbs", host=host) as engine:
        region = engine.register(torch.zeros(nbytes, dtype=torch.uint8))
        print(msgpack.packb({"address": engine.address(), "descriptor": region.descriptor()}).hex(),
              flush=True)
        print(engine.describe(), file=sys.stderr, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20)
