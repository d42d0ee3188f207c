"""Issue #9's clean-exit script: two engines, register, move one table, close both, return.

`python exit_script.py BACKEND MIB` does it once and exits. `... BACKEND MIB N`
first forks N children from this interpreter (torch already imported: a fresh
interpreter per run costs seconds of CPU each) and prints their exit codes as
a JSON list; each child does the work and then leaves through the normal
interpreter exit — atexit, finalisation, static destructors — the path that
aborted with `terminate called without an active exception`. Then the parent,
which has run no engine before (forking leaves no state behind in it), does the
work once itself and exits: its exit status is the fresh-interpreter case, so
one process start covers both. The table is many rows so loopback's copy
helpers run too.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import numpy as np
import torch

from pdxfer import transport


def main(backend: str, mib: int) -> None:
    a, b = transport.create(backend), transport.create(backend)
    nbytes = mib << 20
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    local, remote = a.register(src), b.register(dst)
    rows = 64
    step = nbytes // rows
    table = np.stack([np.arange(rows) * step, np.arange(rows) * step, np.full(rows, step)], 1)
    a.connect(b.address()).write(local, remote.descriptor(), table.astype(np.int64)).wait(60)
    a.close()
    b.close()


if __name__ == "__main__":
    forks = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    # Each child's exit still runs atexit, finalisation and static destructors; frozen, the
    # parent's objects are only skipped by the collector's passes, which otherwise touch (and
    # so copy) every page the fork shares: 7-8 s of each child's exit at load 15, 3 s frozen.
    gc.freeze()
    codes = []
    child = False
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            child = True
            break
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    if not child and forks:
        print(json.dumps(codes), flush=True)
    main(sys.argv[1], int(sys.argv[2]))  # then fall off the end: the real interpreter exit
