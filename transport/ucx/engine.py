"""The ucx engine on the kit: one UCX context, a sending worker, a worker per inbound link, one thread.

What is ucx's on the kit (`transport.engine.EngineBase`): the control
listener's connections become `inbound.UcxInbound`s (each gets a worker of
its own), outbound links are `send.UcxLink`s (endpoints of the engine's one
sending worker), and `progress.Progress` is the only thread that calls UCX
once the constructor has made the context and the sending worker.

Options: `tls` — `"tcp"` (default: UCX's tcp transport only, `drop_peer` a
real fence) or `"all"` (UCX's full list: CUDA memory through UCX's cuda
transports where a GPU is present; `drop_peer` refuses, because a GPU copy
UCX started runs on after its worker is retired — see the package
docstring). `host` is the control listener's address and also limits UCX's
network devices to that interface (`ucxenv.interface_of`), so a loopback
engine's UCX listens on loopback only.

Registration: our `RegionTable` (regions, bounds, overlap refusals) and
nothing more — UCXX's Python API has no memory-map call; UCX registers what
a transfer touches in its registration cache (tcp registers nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
from collections.abc import Mapping
from typing import Any

import pdxfer.transport.ucx.lib as lib  # absolute: `from . import` depends on ucx/__init__
import torch

from ..base import Capabilities
from ..control import LinkRegions
from ..dial import tune
from ..engine import EngineBase
from ..errors import CapabilityError, TransportError
from ..link import Link
from ..listener import DEFAULT_MAX_PENDING, Slot
from ..regions import Region
from ..ucxenv import interface_of
from .inbound import Host, UcxInbound
from .progress import Progress
from .send import UcxLink


def check_tls(tls: Any) -> str:
    """`tls` if it is one the backend offers, else `CapabilityError` naming the choices."""
    if tls not in lib.TLS_CHOICES:
        raise CapabilityError(
            f"ucx option tls must be one of {', '.join(map(repr, lib.TLS_CHOICES))}, got {tls!r}: "
            "'tcp' fences, 'all' is UCX's full transport list (CUDA memory, no fence)")
    return tls


def _current_cuda_device() -> None:
    """UCX's cuda transports work in the calling thread's current CUDA context: the UCX thread's.

    Unverified here (no GPU); `make gpu-check` runs it.
    """
    torch.cuda.set_device(torch.cuda.current_device())


class UcxEngine(EngineBase):
    """A ucx transport engine: UCXX tag messages, announced over a control link, one UCX thread."""

    name = "ucx"
    capabilities = Capabilities(
        cuda_memory=False, cuda_zero_copy=False, cross_process=True,
        one_sided=False, notify=True, read=False,
    )

    @classmethod
    def capabilities_for(cls, options: Mapping[str, Any]) -> Capabilities:
        full = check_tls(options.get("tls", "tcp")) == lib.FULL_TLS
        return dataclasses.replace(cls.capabilities, cuda_memory=full, cuda_zero_copy=full,
                                   fence=not full)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: str = "tcp",
        connect_timeout: float = 10.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`tls`: "tcp" (fenceable) or "all" (UCX's full list). `host`/`port`: the control
        listener (and `host`'s interface is the one UCX may use). `connect_timeout` bounds a
        dial, every inbound handshake and every wait on the UCX thread; `max_pending` caps
        inbound connections still in their handshake."""
        super().__init__(connect_timeout=connect_timeout, options={"tls": tls})
        self.tls = tls
        self.device = interface_of(host)
        self._serial = itertools.count(1)
        # Made here, before the UCX thread exists, and then handed to it: start-up waits on
        # nothing outside this process, so it is no wait for `connect_timeout` to bound (as an
        # `ask` of the UCX thread it once outlasted a 0.5 s connect_timeout at load 14).
        self.context = lib.context(tls, self.device)
        self.worker = lib.worker(self.context)
        self.worker_address = lib.worker_address(self.worker)
        self.progress = Progress(self.engine_id, on_failure=self._ucx_failed)
        try:
            if self.capabilities.cuda_memory and torch.cuda.is_available():
                self.progress.call(_current_cuda_device)
            self.progress.call(lambda: self.progress.adopt(self.worker))
            self.host = Host(self.engine_id, self.progress, self.context, self.regions,
                             self.connect_timeout, self.worker_address)
            self.link_regions = LinkRegions(self.regions, self.inbound, UcxInbound)
            self.listen(host, port, max_pending)
        except BaseException:
            self.progress.stop()
            raise

    def _ucx_failed(self, error: TransportError) -> None:
        """The UCX thread died (`Progress._failed`): every link fails with its error, now."""
        for link in self.outbound.links():
            link.sever(error)
        for inbound in self.inbound.links():
            inbound.fence()  # its worker is never progressed again: the thread is gone

    def why_no_fence(self) -> str:
        return ("with UCX's full transport list (tls='all') a copy UCX started (cuda_ipc, cma) "
                "lands with no progress of ours; use tls='tcp'")

    # -- the kit's hooks ----------------------------------------------------------------
    def open_link(self, address: dict[str, Any]) -> Link:
        return UcxLink(self.link_context(), self.dials, address, self.progress, self.worker,
                       self.worker_address)

    def accept(self, sock: socket.socket, where: str, slot: Slot) -> None:
        tune(sock)
        link = UcxInbound(self.inbound, sock, where, slot, host=self.host, serial=next(self._serial))
        if not (self.inbound.track(link) and link.start(link.run, f"ucx-in {where}")):
            slot.admitted()  # closing: nothing more is served
            sock.close()

    def on_deregister(self, region: Region) -> None:
        self.link_regions.deregistered(region)  # each inbound link tells its sender `Gone`

    @property
    def abandoned_workers(self) -> int:
        """Inbound workers fenced with a receive under way: kept allocated, never progressed."""
        return self.progress.abandoned

    def release(self) -> None:
        """After every link is down: end the UCX thread, then let the sending worker and context go."""
        self.progress.stop()
        self.worker = self.context = None
