"""Registered regions: the one table of what memory an engine lets peers address.

Every backend registers memory the same way — a contiguous tensor viewed as
bytes, refused if it overlaps anything already registered — and describes it
to peers with the same plain dict, so both live here once. A backend adds only
what is its own (e.g. tcp's bounce buffer for CUDA memory).

A region is the parent of the registrations a backend makes over its memory
(`resources.Resource`): deregistering it closes them, newest first (per-link
ones before the engine-wide one), and the engine keeps nothing of it. Only
what still uses the memory holds it: an in-flight transfer holds its
`Region` (so a copy that outlives `deregister` finishes into memory that is
still alive); a link that may still receive a write naming it is settled
before `deregister` returns (nixl: its sender's `GoneAck`, or a fence —
`nixl/inbound.py`), so nothing of the engine keeps it after. Region ids are never reused
within an engine, so a stale descriptor can never address a newer,
different region.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import torch

from .base import LocalRegion
from .errors import BoundsError, CapabilityError, RegistrationError
from .resources import Resource

_DESCRIPTOR_KEYS = ("backend", "engine", "region", "length", "device")


class Region(Resource, LocalRegion):
    """One registered allocation: its bytes as a flat uint8 tensor (and numpy array on CPU).

    Its children are the backend's registrations over it (`adopt`); `close()`
    (by `RegionTable.deregister`) closes them and marks it deregistered.
    """

    def __init__(self, backend: str, engine_id: str, region_id: int, data: torch.Tensor) -> None:
        super().__init__()
        self.backend = backend
        self.engine_id = engine_id
        self.region_id = region_id
        self.data = data  # flat uint8 view of the registered tensor
        self.length = int(data.numel())
        self.device = data.device.type
        self.start = int(data.data_ptr())
        # CPU bytes as numpy / memoryview: slicing these costs ~100 ns, a torch
        # slice ~2 us, which matters at 65,536 segments per transfer.
        self.array: np.ndarray | None = data.numpy() if self.device == "cpu" else None
        self.view: memoryview | None = memoryview(self.array) if self.array is not None else None
        self.registered = True

    def descriptor(self) -> dict[str, Any]:
        """The plain dict a peer passes back to address this region."""
        return {
            "backend": self.backend,
            "engine": self.engine_id,
            "region": self.region_id,
            "length": self.length,
            "device": self.device,
        }

    def release(self) -> None:
        self.registered = False

    def __repr__(self) -> str:
        return f"<{self.backend} region {self.region_id} of {self.engine_id}: {self.length} B {self.device}>"


def byte_view(tensor: Any) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 tensor, or `RegistrationError` saying why not."""
    if not isinstance(tensor, torch.Tensor):
        raise RegistrationError(f"register() takes a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise RegistrationError(
            f"cannot register a non-contiguous tensor (shape {list(tensor.shape)}, "
            f"stride {list(tensor.stride())}); register the allocation it is a view of"
        )
    if tensor.numel() == 0:
        raise RegistrationError("cannot register an empty tensor (0 bytes)")
    if tensor.device.type not in ("cpu", "cuda"):
        raise RegistrationError(f"cannot register memory on device {tensor.device}; use cpu or cuda")
    return tensor.detach().reshape(-1).view(torch.uint8)


class RegionTable:
    """The regions one engine has registered, with the overlap check and id allocation."""

    def __init__(self, backend: str, engine_id: str, *, cuda: bool) -> None:
        self.backend = backend
        self.engine_id = engine_id
        self._cuda = cuda
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)

    def register(self, tensor: Any) -> Region:
        """Register `tensor`'s bytes, refusing overlap with any registered region."""
        data = byte_view(tensor)
        if data.device.type == "cuda" and not self._cuda:
            raise CapabilityError(
                f"the {self.backend} transport cannot register CUDA memory; "
                "register a CPU tensor or use a backend with capabilities.cuda_memory"
            )
        start, end = int(data.data_ptr()), int(data.data_ptr()) + int(data.numel())
        with self._lock:
            for other in self._regions.values():
                if other.data.device != data.device:
                    continue
                if start < other.start + other.length and other.start < end:
                    same = start == other.start and end == other.start + other.length
                    raise RegistrationError(
                        f"memory [{start:#x}, {end:#x}) "
                        + ("is already registered" if same else "overlaps registered")
                        + f" region {other.region_id} [{other.start:#x}, "
                        f"{other.start + other.length:#x}); register each allocation once "
                        "and address parts of it with segment offsets"
                    )
            region = Region(self.backend, self.engine_id, next(self._ids), data)
            self._regions[region.region_id] = region
        return region

    def deregister(self, region: LocalRegion) -> Region | None:
        """Forget `region` and close its registrations (idempotent): the region, if it was ours.

        In-flight transfers that hold the `Region` keep its memory alive.
        """
        with self._lock:
            if not isinstance(region, Region) or self._regions.get(region.region_id) is not region:
                return None
            del self._regions[region.region_id]
        region.close()
        return region

    def get(self, region_id: int) -> Region | None:
        """The live region with this id, or None."""
        return self._regions.get(region_id)

    def live(self) -> list[Region]:
        """Every registered region, oldest first."""
        with self._lock:
            return list(self._regions.values())

    def local(self, region: Any) -> Region:
        """`region` if it is one of ours and still registered, else `RegistrationError`."""
        if not isinstance(region, Region) or region.engine_id != self.engine_id:
            raise RegistrationError(
                f"local region {region!r} was not registered with {self.backend} engine "
                f"{self.engine_id}; register the source buffer on the engine that writes"
            )
        if self._regions.get(region.region_id) is not region:
            raise RegistrationError(
                f"local region {region.region_id} of engine {self.engine_id} was deregistered"
            )
        return region

    def clear(self) -> None:
        """Deregister everything (engine close): each region's registrations close first."""
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.close()


def check_descriptor(desc: Any, backend: str, peer_engine: str) -> tuple[int, int]:
    """`(region_id, length)` of a remote descriptor addressed to `peer_engine`, or an error.

    A descriptor for another backend or another engine than the connection's
    peer is a routing bug in the caller; refusing it here keeps bytes from
    landing in the wrong process.
    """
    if not isinstance(desc, dict) or any(k not in desc for k in _DESCRIPTOR_KEYS):
        got = sorted(desc) if isinstance(desc, dict) else type(desc).__name__
        raise RegistrationError(
            f"remote descriptor must be a dict with keys {list(_DESCRIPTOR_KEYS)}, got {got}; "
            "pass the peer region's descriptor() unchanged"
        )
    if desc["backend"] != backend:
        raise RegistrationError(
            f"descriptor is for backend {desc['backend']!r}, this connection is {backend!r}"
        )
    if desc["engine"] != peer_engine:
        raise RegistrationError(
            f"descriptor addresses engine {desc['engine']!r} but this connection goes to "
            f"{peer_engine!r}; connect to the engine that registered the region"
        )
    region, length = desc["region"], desc["length"]
    for name, value in (("region", region), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BoundsError(f"descriptor {name} must be a non-negative int, got {value!r}")
    return region, length
