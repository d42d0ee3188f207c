"""examples/sglang_adapter.py end to end: prefill in its own process, decode here, checksums.

SGLang-shaped pools on both sides (per-layer bf16 K/V, a Mamba-style state
pool), chunked sends, and the decode scheduler aborting requests mid-transfer
and before any byte: the aborted requests end Failed on both sides with the
reason, and no byte of an aborted request lands outside what was sent before
the abort. Every wait is a poll of the adapter bounded by a deadline, as a
scheduler loop does, or a line from the prefill process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sglang_kit import checksum, seeded_pools

from examples.serving import cross_process
from examples.sglang_adapter import PAGE_SIZE, KVManager, KVReceiver
from pdxfer import EngineConfig, KVPoll, RequestFailed, transport

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Backends that connect two processes (asked of each, not a list of names to drift).
CROSS = [b for b in transport.available() if cross_process(b)]


class Prefill:
    """The prefill process, stepped line by line."""

    def __init__(self, backend: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sglang_prefill_proc.py"), backend],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env)
        self.addr = self.read()["bootstrap"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"prefill process exited ({self.proc.wait(10)})"
        return json.loads(line)

    def write(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


def _until(receiver: KVReceiver, done, deadline_s: float = 30.0) -> KVPoll:
    deadline = time.monotonic() + deadline_s
    while not done(state := receiver.poll()):
        assert time.monotonic() < deadline, f"receiver stuck in {state.name}"
        time.sleep(0.002)
    return state


def _pages_equal(a: dict, b: dict, pages: list[int]) -> bool:
    idx = torch.as_tensor(pages)
    return all(torch.equal(x.view(-1, PAGE_SIZE, *x.shape[1:])[idx], y.view(-1, PAGE_SIZE, *y.shape[1:])[idx])
               for name in ("k", "v") for x, y in zip(a["kv"][name], b["kv"][name], strict=True))


@pytest.mark.parametrize("backend", CROSS)
def test_sglang_adapter_two_processes(backend: str) -> None:
    pools = seeded_pools(96, 8, seed=2)
    before = {g: {n: [t.clone() for t in ts] for n, ts in group.items()} for g, group in pools.items()}
    mgr = KVManager("decode", pools, EngineConfig(transport=backend, timeout=5.0, abort_grace=0.3))
    prefill = Prefill(backend)
    try:
        # Chunked requests: scattered source pages, 3 pages per chunk, state with the last.
        for i, (src, dst, slot) in enumerate([([5, 6, 7, 20, 21, 40, 2], [10, 11, 12, 13, 50, 51, 90], 3),
                                              ([1, 9, 33], [0, 1, 2], 0)]):
            room = f"room-{i}"
            receiver = KVReceiver(mgr, prefill.addr, room)
            assert receiver.poll() is KVPoll.Bootstrapping  # before init: nothing known yet
            receiver.init(dst, [slot])
            prefill.write(json.dumps({"room": room, "pages": src, "slot": slot, "chunk": 3, "mode": "normal"}))
            assert _until(receiver, lambda s: s.finished) is KVPoll.Success
            receiver.failure_exception()  # raises nothing on success
            done = prefill.read()
            assert (done["room"], done["state"], done["reason"]) == (room, "Success", None)
            assert checksum(pools, dst, slot) == done["crc"]
            receiver.clear()

        # Abort mid-transfer: the first chunk went out, the decode gives up.
        untouched = [60, 61, 62]
        receiver = KVReceiver(mgr, prefill.addr, "room-mid")
        receiver.init([70, 71, 72, *untouched], [5])
        prefill.write(json.dumps({"room": "room-mid", "pages": [1, 2, 3, 4, 5, 6], "slot": 1,
                                  "chunk": 3, "mode": "abort-mid"}))
        assert prefill.read()["phase"] == "sent-first"
        receiver.abort()
        assert _until(receiver, lambda s: s.finished) is KVPoll.Failed
        with pytest.raises(RequestFailed, match="decode scheduler aborted the request"):
            receiver.failure_exception()
        done = prefill.read()
        assert done["state"] == "Failed" and "aborted by decode" in done["reason"], done
        assert _pages_equal(pools, before, untouched)
        assert torch.equal(pools["state"]["conv"][0][5], before["state"]["conv"][0][5])

        # Abort before any byte: the prefill sends only after the decode gave up.
        receiver = KVReceiver(mgr, prefill.addr, "room-early")
        receiver.init([80, 81], [6])
        prefill.write(json.dumps({"room": "room-early", "pages": [7, 8], "slot": 2, "chunk": 2,
                                  "mode": "abort-early"}))
        assert prefill.read()["phase"] == "waiting"
        receiver.abort()
        assert _until(receiver, lambda s: s.finished) is KVPoll.Failed
        prefill.write("go")
        done = prefill.read()
        assert done["state"] == "Failed" and "aborted by decode" in done["reason"], done
        assert _pages_equal(pools, before, [80, 81])
        for name, tensors in pools["state"].items():
            assert all(torch.equal(t[6], b[6]) for t, b in zip(tensors, before["state"][name], strict=True))
    finally:
        prefill.close()
        mgr.close()
