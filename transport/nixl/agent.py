"""The nixl backend's edge with NIXL itself: agents, the UCX transport policy, errors translated.

The one module that imports `nixl_cu12`. Importing it configures its "nixl"
logger to print INFO lines on *stdout* (a process's protocol channel: our
peer processes speak on it) and turns off `logging.raiseExceptions` for the
whole process; both are undone here. `make_agent` is the one place that
configures a NIXL agent, `translate` the one place a NIXL exception becomes
ours, and `Initiator` the engine's one initiating agent behind its lock.

The tls policy. UCX transport lists under which only our own progress calls
write into our memory (`FENCEABLE_TLS`: just "tcp") let `drop_peer` fence;
UCX's full list (`FULL_TLS`, "all": cma, cuda_copy/cuda_ipc, rc/dc) moves
VRAM but writes without our progress, so cannot. `check_tls` refuses a list
NIXL would cut at its first comma.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .. import gpudirect
from ..errors import CapabilityError, ClosedError, PeerLostError, RegistrationError, TransportError
from ..ucxenv import interface_of, route_ucx_log

_raise_exceptions = logging.raiseExceptions
from nixl_cu12 import _bindings as nixl_bindings  # noqa: E402
from nixl_cu12 import nixl_agent, nixl_agent_config  # noqa: E402

logging.raiseExceptions = _raise_exceptions
_nixl_log = logging.getLogger("nixl")
for _handler in list(_nixl_log.handlers):
    _nixl_log.removeHandler(_handler)
_nixl_log.propagate = True
_nixl_log.setLevel(logging.WARNING)

log = logging.getLogger(__name__)

__all__ = ["FENCEABLE_TLS", "FULL_TLS", "MAX_BLOCKS", "MAX_PREPARED", "Initiator", "Prepared",
           "block_descs", "check_tls", "cuda_tls", "interface_of", "make_agent", "nixl_agent",
           "nixl_agent_config", "translate"]

# Prepared descriptor lists (#23). A region is prepared as equal blocks of the
# granule its writes use; one list holds at most MAX_BLOCKS blocks (a region
# finer than that is posted unprepared), and one engine's lists — local and
# every link's remote ones together — at most MAX_PREPARED descriptors, least
# recently used released first: a bound flat in peers (measured ~60 B of RSS a
# descriptor; 16,384 local + 16,384 remote ones: +1 MiB).
MAX_BLOCKS = 1 << 18
MAX_PREPARED = 1 << 20

# UCX transport lists under which only our own progress calls write into our
# memory, so drop_peer can fence (see nixl/__init__.py).
FENCEABLE_TLS = frozenset({"tcp"})
# `tls` for UCX's full list (its own default, "all"): cma/sysv/posix shared
# memory, cuda_copy and cuda_ipc for VRAM, rc/dc/ud where a NIC exists.
FULL_TLS = "all"


def cuda_tls(tls: str) -> bool:
    """Whether UCX transport `tls` can move VRAM: the full list, or a cuda/RDMA transport."""
    return tls == FULL_TLS or tls.startswith("cuda") or tls in ("gdr_copy", "rc", "dc")


def check_tls(tls: Any) -> str:
    """`tls` if NIXL can pass it to UCX whole; `CapabilityError` for a list.

    NIXL's UCX `engine_config` is itself a comma-separated `KEY=VALUE` list,
    so `TLS=tcp,cma` reaches UCX as `TLS=tcp`: the rest is dropped without a
    word (measured: `tls="tcp,bogus"` starts). Refuse what would be cut.
    Deletion condition: a NIXL release that escapes or quotes values there.
    """
    if not isinstance(tls, str) or not tls or "," in tls:
        raise CapabilityError(
            f"nixl tls={tls!r}: NIXL cuts a UCX transport list at its first comma; name one "
            f"transport ('tcp': fenceable) or {FULL_TLS!r} for UCX's full list"
        )
    return tls


def make_agent(name: str, tls: str, device: str | None = None) -> nixl_agent:
    """A NIXL agent with one UCX backend restricted to transports `tls`, and no threads of its own.

    No NIXL progress thread and no listener thread: our progress thread is
    the only caller that makes UCX progress, which is what lets `drop_peer`
    stop a peer's bytes. The UCX transport list and, when given, the one
    network interface UCX may use (`device`, as UCX's `NET_DEVICES`) go in
    as backend parameters, never through the environment: another library
    in the process may use UCX differently. Only UCX's log destination must
    be set through it (`ucxenv.route_ucx_log`).

    tcp connects without blocking (`TCP_CONN_NB=y`), as the ucx backend's
    (`ucx/lib.py: context` has the mechanism): NIXL bundles its own UCX
    (1.23.0 in nixl-cu12 1.5.1) and it has the same tcp bug — a peer that
    connected to our worker and died before our endpoint to it was set up
    (loaded after its death) aborted this process in every forced run
    (SIGABRT, `stubs.c:107` from tcp's pending purge;
    `benchmarks/nixl_tcp_abort_repro.py`, docs/reliability.md). NIXL hands
    each `KEY=VALUE` of `engine_config` to `ucp_config_modify` (a `UCX_KEY`
    in the environment wins); under a list without tcp the key is unused.
    Deletion condition: as the ucx backend's, for the UCX nixl-cu12 bundles.
    """
    route_ucx_log()
    engine_config = f"TLS={tls},TCP_CONN_NB=y" + (f",NET_DEVICES={device}" if device else "")
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    try:
        agent = nixl_agent(name, config)
        agent.create_backend("UCX", {"engine_config": engine_config, "ucx_error_handling_mode": "peer"})
    except Exception as exc:
        raise TransportError(
            f"cannot start a NIXL agent with UCX transports {tls!r}"
            + (f" on interface {device!r}" if device else "") + f": {exc}; "
            "check the tls option (e.g. 'tcp') and that nixl-cu12 bundles UCX"
        ) from exc
    return agent


def translate(exc: BaseException, what: str) -> TransportError:
    """Our error for a NIXL exception raised while doing `what` (raise it `from exc`)."""
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, nixl_bindings.nixlRemoteDisconnectError):
        return PeerLostError(f"{what}: the peer disconnected ({exc})")
    if isinstance(exc, nixl_bindings.nixlNotFoundError):
        return RegistrationError(
            f"{what}: NIXL does not know the memory named ({exc}); "
            "register the buffer, or reconnect to refresh the peer's metadata"
        )
    return TransportError(f"{what} failed in NIXL: {type(exc).__name__}: {exc}")


class Registration:
    """One NIXL registration of a region on one agent: a region's child (`resources.Resource`)."""

    def __init__(self, owner: Any, handle: Any, region_id: int) -> None:
        self._owner, self._handle, self._region_id = owner, handle, region_id

    def close(self) -> None:
        self._owner.unregister(self._handle, self._region_id)


def block_descs(base: int, length: int, block: int, gpu: int) -> np.ndarray:
    """NIXL's `(address, length, device)` rows of a region cut into `length // block` equal blocks."""
    n = length // block
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(n, dtype=np.uint64) * block
    out[:, 1] = block
    out[:, 2] = max(gpu, 0)  # host rows name device 0, as NIXL's own DRAM descriptors do
    return out


class Prepared:
    """One engine's prepared descriptor lists, by key, within `MAX_PREPARED` descriptors.

    Keys: `("local", region, block)` for our regions (every link shares
    them), `("remote", link, region, block)` for a peer's. Used and released
    under the initiator's lock only; a list in use by a posted request may be
    released (NIXL copies the descriptors a request names when it is made).
    """

    def __init__(self, budget: int = MAX_PREPARED) -> None:
        self.budget = budget
        self.descs = 0
        self._lists: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], tuple[Any, int]]) -> Any:
        """The list under `key`, prepared by `make() -> (handle, descriptors)` on first use."""
        found = self._lists.get(key)
        if found is not None:
            self._lists.move_to_end(key)
            return found[0]
        handle, n = make()
        self._lists[key] = (handle, n)
        self.descs += n
        while self.descs > self.budget and len(self._lists) > 1:
            self._release(next(iter(self._lists)))
        return handle

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Release every list whose key `match`es (a region gone, a link hung up)."""
        for key in [k for k in self._lists if match(k)]:
            self._release(key)

    def _release(self, key: Hashable) -> None:
        handle, n = self._lists.pop(key)
        self.descs -= n
        try:
            handle.release()
        except Exception as exc:
            log.debug("nixl: releasing a prepared list: %s", exc)

    def __len__(self) -> int:
        return len(self._lists)


class Initiator:
    """The engine's one initiating agent: it registers every region and posts every write.

    Every NIXL call on it holds `lock`; `agent` is None once the engine
    closed. Callers on a write's path never take the lock — posting is the
    progress thread's (`requests.Requests`). `prepared` holds the engine's
    prepared descriptor lists. Peer agents are loaded once per name and
    counted (`load_metadata` / `forget`): links to an engine that serves
    every sender with one agent (`tls="all"`) load the same name.
    """

    def __init__(self, name: str, tls: str, device: str | None) -> None:
        self.lock = threading.Lock()
        self.name = name
        self.agent: Any = make_agent(name, tls, device)
        self._handles: dict[int, Any] = {}  # region id -> registration, deregistered at close
        self._loaded: dict[str, int] = {}  # peer agent -> links that loaded it
        self.prepared = Prepared()

    def local_list(self, region: Any, block: int, gpu: int, mem: str) -> Any:
        """Region `region` prepared as blocks of `block` bytes (lock held)."""
        return self.prepared.get(("local", region.region_id, block), lambda: (
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                       block_descs(region.start, region.length, block, gpu), mem),
            region.length // block))

    def remote_list(self, link: Hashable, agent: str, region: int, base: int, length: int,
                    block: int, gpu: int, mem: str) -> Any:
        """Peer region `region` (seen through `link`'s agent `agent`) prepared as blocks (lock held)."""
        return self.prepared.get(("remote", link, region, block), lambda: (
            self.agent.prep_xfer_dlist(agent, block_descs(base, length, block, gpu), mem),
            length // block))

    def register(self, region: Any) -> Registration:
        """Register a region's memory on this agent (its child under key "initiator")."""
        with self.lock:
            if self.agent is None:
                raise ClosedError("the nixl engine is closed")
            try:
                handle = self.agent.register_memory(region.data)
            except Exception as exc:
                if region.device == "cuda" and not isinstance(exc, TransportError):
                    raise gpudirect.registration_error(  # name what the host lacks for VRAM
                        "NIXL", region.length, f"{type(exc).__name__}: {exc}") from exc
                raise translate(exc, f"registering {region.length} B with NIXL") from exc
            self._handles[region.region_id] = handle
        return Registration(self, handle, region.region_id)

    def unregister(self, handle: Any, region_id: int) -> None:
        with self.lock:
            if self.agent is None or self._handles.pop(region_id, None) is None:
                return
            self.prepared.drop(lambda key: key[0] == "local" and key[1] == region_id)
            try:
                self.agent.deregister_memory(handle)
            except Exception:
                log.exception("nixl: deregistering region %d failed", region_id)

    def load_metadata(self, metadata: bytes, expected: str, *, count: bool = True) -> str:
        """Load a peer agent's metadata (its name must be `expected`); `count`: a new link's first load.

        A reload (`count=False`: the peer registered a region) refreshes the
        metadata of an agent a link already counts.
        """
        with self.lock:
            if self.agent is None:
                raise ClosedError("the nixl engine is closed")
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:
                raise translate(exc, "loading the peer's NIXL metadata") from exc
            name = name.decode() if isinstance(name, bytes) else name
            if name == expected and count:
                self._loaded[name] = self._loaded.get(name, 0) + 1
        if name != expected:
            raise RegistrationError(f"peer metadata is for agent {name!r}, expected {expected!r}")
        return name

    @property
    def registrations(self) -> int:
        """Regions registered on this agent now."""
        return len(self._handles)

    def metadata(self) -> bytes:
        """This agent's metadata (what a peer loads to write to it, when it serves inbound links)."""
        with self.lock:
            if self.agent is None:
                raise ClosedError("the nixl engine is closed")
            return self.agent.get_agent_metadata()

    def invalidate(self, link: Hashable, region: int | None = None) -> None:
        """Release `link`'s prepared lists (of `region`, or all): the peer's metadata changed."""
        with self.lock:
            self.prepared.drop(lambda key: key[0] == "remote" and key[1] == link
                               and (region is None or key[2] == region))

    def forget(self, agent_name: str, link: Hashable) -> None:
        """A link to `agent_name` ended: release its prepared lists; unload the agent with its last link."""
        with self.lock:
            if self.agent is None:
                return
            self.prepared.drop(lambda key: key[0] == "remote" and key[1] == link)
            left = self._loaded.get(agent_name, 0) - 1
            if left > 0:
                self._loaded[agent_name] = left
                return
            self._loaded.pop(agent_name, None)
            try:
                self.agent.remove_remote_agent(agent_name)
            except Exception as exc:
                log.debug("nixl: removing agent %s: %s", agent_name, exc)

    def close(self, before: Any = None) -> None:
        """Deregister what is left, run `before()` (lock held), and let the agent go: its UCX worker ends."""
        with self.lock:
            if before is not None:
                before()
            self.prepared.drop(lambda key: True)
            for region_id, handle in self._handles.items():
                try:
                    self.agent.deregister_memory(handle)
                except Exception:
                    log.debug("nixl: deregistering region %d at close failed", region_id)
            self._handles.clear()
            agent, self.agent = self.agent, None
            del agent  # the last reference: the NIXL agent and its UCX worker go now
