"""The engine half of the kit: what every backend's `TransportEngine` is, written once.

`EngineBase` owns, for every backend:

* **capabilities from options, in one place.** `capabilities_for(options)`
  (a classmethod) computes an instance's flags from its constructor options;
  the constructor and `transport.capabilities(name)` both call it, so a
  named variant (`nixl-all`) cannot report one thing by name and another as
  an engine (#25 item 7).
* **options.** `check_options` refuses, before anything is built, an option
  the backend does not take (`CapabilityError` naming it and the valid
  ones) and a common option of the wrong type. `COMMON_OPTIONS` (`host`,
  `connect_timeout`) are the ones a deployment passes to whichever backend
  it names (pdxfer's engines pass both); every backend accepts them, and a
  backend with no use for one lists it in `UNUSED_OPTIONS` (loopback: it has
  no socket and never waits). Nothing else is accepted and ignored.
* **regions** (`regions.RegionTable`): registration, the overlap refusals,
  and deregistration closing each region's children (`resources.Resource`).
* **peers.** The outbound table (one live link per peer, never two when two
  threads connect at once, a dead one replaced), the inbound table
  (`inbound.InboundTable`: `has_peer`, `settled`, the seal and the fence
  by sender), the notify
  handler (its exceptions logged, never killing a link).
* **the fence refusal.** `drop_peer` raises `CapabilityError` whenever
  `capabilities.fence` is False — derived from the flag, so no backend can
  declare "cannot fence" and return from `drop_peer` anyway (#25 item 6).
* **device temporaries** (`device_copy.Scratches`): one bounded scratch per
  CUDA device for every batched device copy the engine's links make
  (loopback's CUDA path, tcp's bounce), allocated on first use.
* **the listener** (`listener.Listener`, IPv4/IPv6, pending cap, deadlines,
  pre-handshake frame cap) for every backend that listens, and the dials in
  progress (`dial.Dials`), which `close()` ends.
* **close order**, idempotent and bounded: stop accepting; end dials in
  progress; fence every inbound link (nothing lands, no notify starts);
  close every outbound link (in-flight work fails with `ClosedError`, its
  threads joined); stop the readiness thread; the backend's own `release()`
  (progress threads, agents, device contexts); join inbound threads;
  deregister every region.

A backend supplies `open_link(address)` (build its `Link` to a peer) and,
if it listens, `accept(sock, where, slot)`; everything else it may leave to
the base.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch

from . import closing
from .base import Capabilities, Connection, LocalRegion, NotifyHandler, TransportEngine
from .closing import BYE_WAIT
from .device_copy import Scratches
from .dial import Dials
from .errors import CapabilityError, ClosedError, RegistrationError, TransportError
from .inbound import InboundTable
from .link import Link, LinkContext
from .listener import DEFAULT_MAX_PENDING, Listener, Slot
from .posting import Readiness
from .regions import RegionTable

log = logging.getLogger(__name__)

COMMON_OPTIONS = frozenset({"host", "connect_timeout"})
JOIN_TIMEOUT = 2.0


def check_options(cls: type, params: frozenset[str], options: Mapping[str, Any]) -> None:
    """Refuse options `cls` does not take, and common options of the wrong type, naming the fix."""
    unknown = sorted(set(options) - params)
    if unknown:
        raise CapabilityError(
            f"transport {cls.name!r} has no option {unknown[0]!r}; its options: "
            f"{', '.join(sorted(params))}")
    host = options.get("host", "127.0.0.1")
    if not isinstance(host, str):
        raise CapabilityError(f"{cls.name} option host must be a host name or address, got {host!r}")
    port = options.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise CapabilityError(f"{cls.name} option port must be an int 0..65535, got {port!r}")
    check_seconds(cls.name, "connect_timeout", options.get("connect_timeout", 10.0))
    pending = options.get("max_pending", DEFAULT_MAX_PENDING)
    if isinstance(pending, bool) or not isinstance(pending, int) or pending < 1:
        raise CapabilityError(f"{cls.name} option max_pending must be a positive int, got {pending!r}")


def check_seconds(backend: str, name: str, value: Any) -> float:
    """A finite, positive duration, or `CapabilityError` naming the option."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise CapabilityError(
            f"{backend} option {name} must be a finite, positive number of seconds, got {value!r}")
    return float(value)


def forced_fence(caps: Capabilities, backend: str, fence: Any) -> Capabilities:
    """`caps` with the fence switched off by a `fence=False` option (loopback, tcp).

    `fence=False` exists so the engine's no-fence path (quarantine) runs on
    backends that could fence; it is never a default, so production code
    cannot lose the fence without writing it, and `drop_peer` then refuses.
    """
    if not isinstance(fence, bool):
        raise CapabilityError(f"{backend} option fence must be True or False, got {fence!r}")
    return replace(caps, fence=caps.fence and fence)


class Outbound:
    """One engine's outbound links: one live link per peer engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}
        self._goodbyes: set[threading.Thread] = set()  # dead links still draining (`farewell`)
        self._unclosed: list[Link] = []  # taken out of the table by close, not closed yet
        self._closed = False

    def live(self, peer: str) -> Link | None:
        """The cached live link to `peer`, or None."""
        with self._lock:
            link = self._links.get(peer)
        return link if link is not None and link.alive else None

    def install(self, peer: str, fresh: Link) -> tuple[Link, Link | None]:
        """Cache `fresh` unless another thread connected meanwhile: `(link to use, spare to close)`.

        `ClosedError` (after closing `fresh`) if the engine is closing.
        """
        with self._lock:
            closed = self._closed
            current = self._links.get(peer)
            if not closed:
                if current is not None and current.alive and current is not fresh:
                    return current, fresh
                self._links[peer] = fresh
        if closed:
            fresh.close()
            raise ClosedError("the engine closed while connecting")
        return fresh, None

    def forget(self, link: Link) -> None:
        """Drop `link` if it is the cached one (it died)."""
        with self._lock:
            if self._links.get(link.peer) is link:
                del self._links[link.peer]

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def close(self, deadline: float) -> bool:
        """Close every link at once (in-flight work fails with `ClosedError`), all under `deadline`.

        Each link's close (its `Bye`, its wait for the peer to hang up, its
        threads joined) runs on its own thread, so the bound is `deadline`,
        not one link's bound per peer in turn. False if a link or a goodbye
        was still finishing at the deadline; a link whose close raised is kept
        and closed again by the next call (`CloseError` naming it).
        """
        with self._lock:
            self._closed = True
            self._unclosed.extend(self._links.values())
            self._links.clear()
            links = list(self._unclosed)
        done: list[Link] = []

        def shut(link: Link) -> None:
            link.close()
            done.append(link)

        try:
            running = closing.concurrently("outbound links", links, shut, deadline,
                                           name=lambda link: f"link to {link.peer}")
        finally:
            with self._lock:
                self._unclosed = [link for link in self._unclosed
                                  if not any(link is d for d in done)]
        with self._lock:
            goodbyes = list(self._goodbyes)
        for thread in goodbyes:  # each bounded by its drain and its Bye; all by the deadline
            thread.join(closing.left(deadline))
        with self._lock:
            self._goodbyes = {t for t in self._goodbyes if t.is_alive()}
            return not running and not self._goodbyes

    def farewell(self, thread: threading.Thread) -> None:
        """A dead link's goodbye thread (`ControlledLink`): joined by `close`; finished ones dropped."""
        with self._lock:
            self._goodbyes = {t for t in self._goodbyes if t.is_alive()}
            self._goodbyes.add(thread)


class EngineBase(TransportEngine):
    """A transport engine on the kit. Subclasses set `name`, `capabilities` and the hooks."""

    name: ClassVar[str]
    capabilities: Capabilities  # the class's: defaults; an instance's: from its options
    UNUSED_OPTIONS: ClassVar[frozenset[str]] = frozenset()
    # Whether a `fence=False` option switches this backend's fence off (`forced_fence`).
    FENCE_OPTION: ClassVar[bool] = False

    @classmethod
    def capabilities_for(cls, options: Mapping[str, Any]) -> Capabilities:
        """This backend's capabilities with these constructor options (the one place they are computed)."""
        if cls.FENCE_OPTION:
            return forced_fence(cls.capabilities, cls.name, options.get("fence", True))
        return cls.capabilities

    def __init__(self, *, connect_timeout: float, options: Mapping[str, Any]) -> None:
        """`options`: the constructor options that decide capabilities (see `capabilities_for`)."""
        self.capabilities = type(self).capabilities_for(options)
        self.engine_id = f"{self.name}-{uuid.uuid4().hex[:12]}"
        self.connect_timeout = check_seconds(self.name, "connect_timeout", connect_timeout)
        self.regions = RegionTable(self.name, self.engine_id, cuda=self.capabilities.cuda_memory)
        self.inbound = InboundTable(self.name, self._notify, self_settles=self.cut_settles)
        self.outbound = Outbound()
        self.readiness = Readiness(self.engine_id)
        self.scratches = Scratches()  # device temporaries, bounded per engine (made on first use)
        self.dials = Dials()
        self.listener: Listener | None = None
        self._handler: NotifyHandler | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._closing = closing.Steps(f"{self.name} engine {self.engine_id}")

    # -- what links and helpers get ----------------------------------------------
    def link_context(self, backend: str | None = None) -> LinkContext:
        """The narrow view of this engine a link gets (`backend`: the descriptors' backend name)."""
        return LinkContext(backend or self.name, self.engine_id, self.regions, self.readiness,
                           self.connect_timeout, self.outbound.forget, not self.cut_settles,
                           self.outbound.farewell)

    @property
    def cut_settles(self) -> bool:
        """Whether stopping a link's data path on our side proves none of its bytes lands later.

        True where this engine could fence (`capabilities.fence`, or a backend
        whose fence a `fence=False` option only switched off: its own reading
        or copying still lands every byte). False where a peer writes into our
        memory with nothing here able to stop it (nixl-all, verbs
        `fence="qp"`, ucx-all): such a link settles only on its sender's word
        (`Bye(quiet=True)`) or death, and our own links of that kind drain
        before they say goodbye (`LinkContext.drains`).
        """
        return self.capabilities.fence or type(self).FENCE_OPTION

    # -- memory ------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> LocalRegion:
        self.check_open()
        region = self.regions.register(tensor)
        try:
            self.on_register(region)
        except BaseException:
            self.regions.deregister(region)
            raise
        return region

    def on_register(self, region: Any) -> None:
        """Make the backend's registrations over a new region (its children). Raises to refuse it."""

    def deregister(self, region: LocalRegion) -> None:
        found = self.regions.deregister(region)
        if found is not None:
            self.on_deregister(found)

    def on_deregister(self, region: Any) -> None:
        """The region is gone (its children closed): tell peers, if the backend does."""

    # -- peers -------------------------------------------------------------------
    def address(self) -> dict[str, Any]:
        addr = {"backend": self.name, "engine": self.engine_id}
        if self.listener is not None:
            addr.update(host=self.listener.host, port=self.listener.port)
        return addr

    def connect(self, peer_address: dict[str, Any]) -> Connection:
        self.check_open()
        addr = peer_address if isinstance(peer_address, dict) else {}
        peer = addr.get("engine")
        host, port = addr.get("host"), addr.get("port")
        listens = self.capabilities.listens
        if (addr.get("backend") != self.name or not isinstance(peer, str)
                or (listens and (not isinstance(host, str) or isinstance(port, bool)
                                 or not isinstance(port, int)))):
            raise RegistrationError(
                f"not a {self.name} address: {peer_address!r}; pass the peer engine's address()"
                + (" (backend, engine, host, port)" if listens else ""))
        link = self.outbound.live(peer)
        if link is not None:
            return link
        fresh = self.open_link(addr)  # may dial: no lock held
        link, spare = self.outbound.install(peer, fresh)
        if spare is not None:
            spare.close()
        return link

    def open_link(self, address: dict[str, Any]) -> Link:
        """Build this backend's link to the engine at `address` (checked: backend, engine[, host, port])."""
        raise NotImplementedError

    def set_notify_handler(self, handler: NotifyHandler | None) -> None:
        self._handler = handler

    def _notify(self, sender: str, payload: bytes) -> None:
        handler = self._handler
        if handler is None or self._closed:
            return
        try:
            handler(sender, payload)
        except Exception:  # the handler is the caller's code; its bug must not kill the link
            log.exception("notify handler raised for a payload from %s", sender)

    def drop_peer(self, engine_id: str) -> None:
        if not self.capabilities.fence:
            raise CapabilityError(
                f"{self.name} engine {self.engine_id} cannot fence a peer: {self.why_no_fence()}")
        self.inbound.fence(engine_id)

    def progress_failed(self, error: TransportError) -> None:
        """The backend's progress thread died (`loop_thread.LoopThread`): every link fails now.

        Outbound links are severed with `error` (their handles fail with it,
        not after their own timeouts); inbound links are fenced — nothing
        progresses them any more, so nothing of theirs may be delivered.
        Runs on a thread of its own, after the loop's thread ended.
        """
        for link in self.outbound.links():
            link.sever(error)
        for inbound in self.inbound.links():
            inbound.fence()

    def why_no_fence(self) -> str:
        """Why this instance's `capabilities.fence` is False (the refusal's reason)."""
        return "it was created with fence=False"

    def has_peer(self, engine_id: str) -> bool:
        return self.inbound.has_peer(engine_id)

    def usage(self) -> dict[str, int]:
        out = {"links_out": len(self.outbound.links()), "links_in": len(self.inbound.links()),
               "threads": threading.active_count(),
               "device_scratch_bytes": self.scratches.allocated_bytes}
        out.update(self.backend_usage())
        return out

    def backend_usage(self) -> dict[str, int]:
        """The backend's own entries of `usage()`."""
        return {}

    def settled(self, engine_id: str, incarnation: str | None = None) -> bool:
        return self.inbound.settled(engine_id, incarnation)

    def refuse_new_links(self, engine_id: str) -> None:
        self.inbound.seal(engine_id)

    # -- listening -----------------------------------------------------------------
    def listen(self, host: str, port: int, max_pending: int) -> None:
        """Open the hardened control listener (`accept` gets each connection)."""
        self.listener = Listener(self.name, host, port, self.accept,
                                 handshake_timeout=self.connect_timeout, max_pending=max_pending)

    def accept(self, sock: Any, where: str, slot: Slot) -> None:
        """A connection arrived on the listener (listening backends)."""
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.name} engine {self.engine_id} is closed")

    @property
    def close_timeout(self) -> float:
        """The one bound on a whole `close()`, whatever the number of peers.

        A link's close may drain (`connect_timeout`), then waits `BYE_WAIT`
        for its peer to hang up; every link does that at once, and the
        joins of what the engine started share what is left of it.
        """
        return self.connect_timeout + BYE_WAIT + JOIN_TIMEOUT

    def close(self) -> None:
        """Close everything, in the kit's order, under one deadline (`close_timeout`).

        Every step runs even if an earlier one raised; the failures are raised
        once at the end (`CloseError`, naming each step). A second `close()`
        after a failed or unfinished one runs again only the steps that did
        not finish; a `close()` while another runs returns at once.
        """
        with self._close_lock:
            self._closed = True
        if self._closing.finished:
            return
        deadline = time.monotonic() + self.close_timeout

        def listener() -> None:
            if self.listener is not None:
                self.listener.close(min(JOIN_TIMEOUT, closing.left(deadline)))

        self._closing.run([
            ("stop the listener", listener),
            ("end dials in progress", self.dials.abort),
            ("fence inbound links", self.inbound.close),
            ("close outbound links", lambda: self.outbound.close(deadline)),
            ("stop the readiness thread", self.readiness.close),
            ("release the backend", self.release),
            ("join inbound threads", lambda: self.inbound.join(closing.left(deadline))),
            ("deregister regions", self.regions.clear),
            ("after close", self.after_close),
        ])

    def release(self) -> None:
        """The backend's own shutdown, after every link is down: progress threads, agents, devices."""

    def after_close(self) -> None:
        """After the regions are gone: what must outlive them (a device context)."""
