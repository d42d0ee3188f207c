"""One request between two processes, run by an installed pdxfer (tests/test_wheel_install.py).

`python installed_transfer.py` is the prefill: it starts the decode as a
child process (`... decode ADDRESS`), sends one request of four scattered
entries, and exits 0 once both sides report Success and the child checked
every byte it received. Both print where `pdxfer` was imported from, so the
test can tell an installed package from a checkout on the path.

The prefill sends only once the child says it expects the request: the
child's start (a torch import: 15-20 s of wall time on two loaded cores)
stays out of the request's 20 s bound.
"""

from __future__ import annotations

import subprocess
import sys

import torch

import pdxfer
from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, layout

FIELDS = [layout.EntryField("k", 2, (4, 8), torch.float32),
          layout.EntryField("v", 2, (4, 8), torch.float32)]
SRC, DST = [5, 1, 6, 2], [0, 7, 3, 4]
CONFIG = EngineConfig(transport="tcp", timeout=20.0)


def _values(entry: int, name: str) -> torch.Tensor:
    """What source entry `entry` of field `name` holds: every element distinct."""
    base = entry * 1000 + (0 if name == "k" else 500)
    return torch.arange(base, base + 2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8)


def decode(address: str) -> int:
    arena = layout.EntryMajorArena(FIELDS, 8, "cpu")
    with DecodeEngine({"kv": arena}, CONFIG) as engine:
        engine.expect("r0", address, {"kv": DST})
        print("EXPECTING r0", flush=True)
        assert engine.wait("r0", timeout=20) == KVPoll.Success
        for s, d in zip(SRC, DST, strict=True):
            for name in ("k", "v"):
                got = arena.view(name)[:, d]
                if not torch.equal(got, _values(s, name)):
                    print(f"entry {d} field {name}: wrong bytes", file=sys.stderr)
                    return 1
    print(f"decode imported pdxfer from {pdxfer.__file__}; 4 entries checked")
    return 0


def prefill() -> int:
    arena = layout.EntryMajorArena(FIELDS, 8, "cpu")
    for s in SRC:
        for name in ("k", "v"):
            arena.view(name)[:, s] = _values(s, name)
    with PrefillEngine({"kv": arena}, CONFIG) as engine:
        child = subprocess.Popen([sys.executable, __file__, "decode", engine.bootstrap_address],
                                 stdout=subprocess.PIPE, text=True)
        try:
            said = child.stdout.readline()  # "" if the child died first
            assert said == "EXPECTING r0\n", f"decode child said {said!r}, exit {child.wait(30)}"
            engine.send("r0", {"kv": SRC})
            assert engine.wait("r0", timeout=20) == KVPoll.Success
            code = child.wait(timeout=30)
            print(child.stdout.read(), end="")  # the child's own line, for the test
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    print(f"prefill imported pdxfer from {pdxfer.__file__}; decode exited {code}")
    return code


if __name__ == "__main__":
    sys.exit(decode(sys.argv[2]) if sys.argv[1:2] == ["decode"] else prefill())
