"""Raw NIXL, driven the way a tuned NIXL user drives it: the baseline our `nixl` backend must meet.

`pdxfer bench transport` puts our backends beside NIXL agents used
directly on the same buffers and segment tables: both descriptor lists
prepared once per table (`prep_xfer_dlist`), one prepared request
(`make_prepped_xfer`) reposted for every timed run with a fresh
notification (`transfer(handle, tag)`), NIXL's own progress thread on, and
completion taken when the receiving agent holds the notification (NIXL
sends it after the data). Nothing of ours is on that path: no table check,
no planning per write, no acknowledgement frame — so the ratio to it is
what our contract (checks, fences, handles) and our posting cost.

Two configurations: UCX restricted to `tls` (the transports our nixl
backend uses, `tcp`) and UCX's default choice (`""`: on one host, shared
memory / cma single-copy), which is what a NIXL user gets without asking
and what our tcp backend is measured against.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import numpy as np
import torch

_ids = itertools.count()


def agent(name: str, tls: str, device: str = "") -> Any:
    """A NIXL agent with NIXL's defaults (progress thread on) and UCX limited to `tls` if given.

    With `device`, exactly our nixl backend's agent instead (`transport.nixl.agent.make_agent`:
    UCX on that one interface, peer error handling, no progress thread — the
    polling loops here progress it), to tell NIXL's cost from our configuration's.
    """
    # Through the transport's NIXL edge: importing nixl_cu12 there routes its
    # log records away from stdout, which a bench child speaks on.
    from pdxfer.transport.nixl.agent import make_agent, nixl_agent, nixl_agent_config

    if device:
        return make_agent(name, tls, device)
    if not tls:
        return nixl_agent(name, nixl_agent_config())
    a = nixl_agent(name, nixl_agent_config(backends=[]))
    a.create_backend("UCX", {"engine_config": f"TLS={tls}"})
    return a


def _descs(base: int, table: np.ndarray, col: int) -> np.ndarray:
    out = np.zeros((table.shape[0], 3), dtype=np.uint64)
    out[:, 0] = table[:, col] + base
    out[:, 1] = table[:, 2]
    return out


class RawNixlPair:
    """A sending NIXL agent here and a receiving one in `peer` (this process or a child)."""

    def __init__(self, src: np.ndarray, peer: Any, tls: str, device: str = "") -> None:
        tag = f"{uuid.uuid4().hex[:8]}-{next(_ids)}"
        self.tx_name, self.rx_name = f"raw-tx-{tag}", f"raw-rx-{tag}"
        self.peer = peer
        self.tx = agent(self.tx_name, tls, device)
        self.tx.register_memory(torch.from_numpy(src))
        info = peer.call("nixl", name=self.rx_name, tls=tls, device=device)
        self.tx.add_remote_agent(info["metadata"])
        self.src_base, self.dst_base = src.ctypes.data, info["base"]
        self._prepped: list[Any] = []
        self.handle: Any = None
        self._seq = itertools.count()

    def prepare(self, table: np.ndarray) -> None:
        """Prepare both descriptor lists and one request for `table` (untimed, once per case)."""
        self._release()
        local = self.tx.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(self.src_base, table, 0), "DRAM")
        remote = self.tx.prep_xfer_dlist(self.rx_name, _descs(self.dst_base, table, 1), "DRAM")
        self._prepped = [local, remote]
        idx = np.arange(table.shape[0], dtype=np.int32)
        self.handle = self.tx.make_prepped_xfer("WRITE", local, idx, remote, idx, b"prep")

    def move(self) -> None:
        """Repost the prepared request; return when the receiver holds its notification."""
        tag = b"run-%d" % next(self._seq)
        landed = self.peer.start("nixl_wait", name=self.rx_name, sender=self.tx_name, tag=tag)
        state = self.tx.transfer(self.handle, tag)
        deadline = time.monotonic() + 60
        # The initiator is polled as a NIXL user polls it: NIXL's UCX backend
        # posts the notification from the status check that sees the data done.
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise SystemExit(f"raw NIXL transfer ended in state {state}")
            time.sleep(20e-6)
            state = self.tx.check_xfer_state(self.handle)
        landed()

    def _release(self) -> None:
        if self.handle is not None:
            self.handle.release()
            self.handle = None
        for h in self._prepped:
            h.release()
        self._prepped = []

    def close(self) -> None:
        self._release()
