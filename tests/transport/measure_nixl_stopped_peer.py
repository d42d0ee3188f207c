"""Measure: does a SIGSTOPped nixl peer with a write in flight delay another peer? (#29.3; not a test)

The issue's suspect on nixl: `NixlLink.hang_up_path` releases the dead
link's requests and `remove_remote_agent`s its peer under the initiator's
lock, which the progress thread needs for every post and poll; if either
NIXL call waited for the stopped peer (NIXL PR 2101 proposes a synchronous
endpoint close in `disconnect()`), every other peer's writes would wait
too. This drives NIXL directly, the way our progress thread does (one
thread, no NIXL threads, tls=tcp): warm a write to child 1, SIGSTOP it,
start a 256 MiB write to it, release that request and remove its agent
(timed), then write 256 MiB to a healthy child 2 (timed, twice).

Run: `.venv/bin/python tests/transport/measure_nixl_stopped_peer.py`.
nixl-cu12 1.5.1, here (2 loaded cores), three runs: release 0.000 s and
remove 0.000 s every time; child 2's writes then 0.23-0.88 s, as fast as
the warm write to child 1 before the stop (0.40-0.78 s). Neither call waits on the
stopped peer in this version, so this is not what delayed D2.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch
from pdxfer.transport.nixl.agent import make_agent

N = 256 << 20


def serve(name: str, q: mp.Queue) -> None:
    agent = make_agent(name, "tcp")
    buf = torch.zeros(N, dtype=torch.uint8)
    agent.register_memory(buf)
    q.put((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(buf))))
    while True:  # progress our side, as the receiving engine's loop does
        agent.get_new_notifs()
        time.sleep(0.001)


def write(agent, local, remote, name: str, note: bytes, limit: float = 30.0) -> tuple[str, float]:
    xfer = agent.initialize_xfer("WRITE", local, remote, name, note)
    agent.transfer(xfer)
    t0 = time.monotonic()
    while agent.check_xfer_state(xfer) == "PROC" and time.monotonic() - t0 < limit:
        pass
    state = agent.check_xfer_state(xfer)
    agent.release_xfer_handle(xfer)
    return state, time.monotonic() - t0


def main() -> None:
    ctx = mp.get_context("spawn")
    children = []
    for name in ("child1", "child2"):
        q = ctx.Queue()
        proc = ctx.Process(target=serve, args=(name, q), daemon=True)
        proc.start()
        children.append((proc, *q.get(timeout=120)))
    agent = make_agent("parent", "tcp")
    src = torch.ones(N, dtype=torch.uint8)
    agent.register_memory(src)
    local = agent.get_xfer_descs(src)
    (p1, md1, d1), (p2, md2, d2) = children
    try:
        name1 = agent.add_remote_agent(md1)
        remote1 = agent.deserialize_descs(d1)
        print("warm write to child1:", write(agent, local, remote1, name1, b"warm"), flush=True)
        os.kill(p1.pid, signal.SIGSTOP)
        big = agent.initialize_xfer("WRITE", local, remote1, name1, b"big")
        agent.transfer(big)
        for _ in range(2000):
            agent.check_xfer_state(big)
        print("big write to the stopped child1:", agent.check_xfer_state(big), flush=True)
        t0 = time.monotonic()
        agent.release_xfer_handle(big)
        print(f"release_xfer_handle: {time.monotonic() - t0:.3f} s", flush=True)
        t0 = time.monotonic()
        agent.remove_remote_agent(name1)
        print(f"remove_remote_agent: {time.monotonic() - t0:.3f} s", flush=True)
        name2 = agent.add_remote_agent(md2)
        remote2 = agent.deserialize_descs(d2)
        for note in (b"h1", b"h2"):
            print("write to the healthy child2:", write(agent, local, remote2, name2, note), flush=True)
    finally:
        for proc in (p1, p2):
            os.kill(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
