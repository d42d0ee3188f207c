"""What the nixl backend says besides NIXL itself: control frames, the notification, agents.

NIXL moves the bytes and carries one notification per transfer; everything
else — who is connecting, which regions exist at which addresses, which
transfers landed, a peer going away — travels on one small TCP control
connection per link, in `transport.wire` frames of protocol `pdxfer-nixl`:

  sender → receiver: `Hello` once, `Refresh` (a region unknown to us was
  named), `Bye` (we are closing: fence us);
  receiver → sender: `Welcome` (its NIXL agent's metadata and its regions),
  `Regions` (answer to `Refresh`), `Acks` (these transfers landed and their
  notify was delivered), `Gone` (a region was deregistered).

The control connection is also how a dead peer is noticed: UCX over tcp may
take long to declare a killed process gone, a closed socket is seen at once.

Every NIXL transfer carries a `Note` as its notification — the transfer's
sequence number and the caller's notify payload, if any — so the receiver
can acknowledge each transfer even when the caller sent no payload.

Also here: `make_agent`, the one place that configures a NIXL agent, and
`translate`, the one place that turns a NIXL exception into ours.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .control_link import Acks, Bye, Gone, Refresh
from .errors import CapabilityError, PeerLostError, RegistrationError, TransportError
from .wire import LENGTH, Protocol

# Importing nixl_cu12 configures its "nixl" logger to print INFO lines on
# *stdout* (a process's protocol channel: our peer processes speak on it)
# and turns off logging.raiseExceptions for the whole process. Undo both
# here, at the edge: NIXL's records go to the standard logging tree, from
# WARNING up, like every other library's.
_raise_exceptions = logging.raiseExceptions
from nixl_cu12 import _bindings as nixl_bindings  # noqa: E402
from nixl_cu12 import nixl_agent, nixl_agent_config  # noqa: E402

logging.raiseExceptions = _raise_exceptions
_nixl_log = logging.getLogger("nixl")
for _handler in list(_nixl_log.handlers):
    _nixl_log.removeHandler(_handler)
_nixl_log.propagate = True
_nixl_log.setLevel(logging.WARNING)

VERSION = 2  # 2: region rows carry the CUDA device (-1: host)


@dataclass(frozen=True)
class Hello:
    """First frame from a connecting sender: its engine id (= its NIXL agent's name)."""

    TYPE: ClassVar[str] = "hello"
    engine: str


@dataclass(frozen=True)
class Welcome:
    """The receiver's answer: the agent that serves this link alone, and the regions it may write."""

    TYPE: ClassVar[str] = "welcome"
    engine: str
    agent: str
    metadata: bytes  # the serving agent's full NIXL metadata
    regions: bytes  # little-endian int64 rows (region_id, address, length, gpu; -1 host)


@dataclass(frozen=True)
class Regions:
    """Answer to `Refresh`: fresh metadata and the full region list."""

    TYPE: ClassVar[str] = "regions"
    query: int
    metadata: bytes
    regions: bytes


@dataclass(frozen=True)
class Note:
    """The NIXL notification of one transfer: delivered by NIXL after its bytes."""

    TYPE: ClassVar[str] = "note"
    seq: int
    payload: bytes | None


CONTROL = Protocol(
    "pdxfer-nixl", VERSION, [Hello, Welcome, Refresh, Regions, Acks, Gone, Bye], max_frame=16 << 20
)
NOTES = Protocol("pdxfer-nixl-note", VERSION, [Note], max_frame=128 * 1024)


def pack_note(seq: int, payload: bytes | None) -> bytes:
    """A `Note` as NIXL notification bytes (the frame body, without its length prefix)."""
    return NOTES.pack(Note(seq, payload))[LENGTH.size:]


def unpack_note(data: bytes) -> Note:
    """The `Note` in a NIXL notification; `ProtocolError` for anything else."""
    NOTES.check_length(len(data))
    return NOTES.unpack(data)


def ints(data: bytes, width: int, what: str) -> np.ndarray:
    """Raw little-endian int64 bytes as an `[n, width]` array (`ProtocolError` if ragged)."""
    from .errors import ProtocolError

    if len(data) % (8 * width):
        raise ProtocolError(f"{what}: {len(data)} B is not a whole number of {width}-int rows")
    return np.frombuffer(data, dtype="<i8").reshape(-1, width).astype(np.int64)


def recv_control(sock: socket.socket, limit: int | None = None) -> Any:
    """One control message (at most `limit` B); a closed or reset socket is `PeerLostError`."""
    return CONTROL.recv(sock, limit)


# -- NIXL agents ------------------------------------------------------------------

def _route_ucx_log() -> None:
    """Send UCX's own log lines to stderr, never to stdout (a worker's protocol channel).

    UCX reads its global log options once, from the environment, when
    libucs loads — at the first UCX backend this process creates, i.e. in
    `make_agent` — and they cannot be passed as a backend parameter. So this
    is the one place the library writes to `os.environ`, and only
    `UCX_LOG_FILE`, and only when it is unset or `stdout`: anyone who chose a
    file keeps it.
    """
    if os.environ.get("UCX_LOG_FILE", "stdout") in ("", "stdout"):
        os.environ["UCX_LOG_FILE"] = "stderr"


def interface_of(host: str) -> str | None:
    """The network interface holding address `host`, or None (a wildcard, or not found).

    UCX's tcp transport listens on every interface it is allowed; limiting it
    (`NET_DEVICES`) to the interface of the host we were given keeps a
    loopback-only engine off the cluster network.
    """
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        wanted = {ipaddress.ip_address(info[4][0].split("%")[0])
                  for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        if any(ip.is_loopback for ip in wanted) and _addresses(name) & {
                ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}:
            return name
        if _addresses(name) & wanted:
            return name
    return None


def _addresses(name: str) -> set[Any]:
    """The IPv4 address (ioctl SIOCGIFADDR) and IPv6 addresses (/proc) of interface `name`."""
    out: set[Any] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            out.add(ipaddress.ip_address(raw[20:24]))
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                cols = line.split()
                if len(cols) == 6 and cols[5] == name:
                    out.add(ipaddress.ip_address(int(cols[0], 16)))
    except OSError:
        pass
    return out


def mem_type(gpu: int) -> str:
    """NIXL's memory type for a region on CUDA device `gpu` (-1: host memory)."""
    return "DRAM" if gpu < 0 else "VRAM"


# UCX transport lists under which only our own progress calls write into our
# memory, so drop_peer can fence (see the module docstring).
FENCEABLE_TLS = frozenset({"tcp"})
# `tls` for UCX's full list (its own default, "all"): cma/sysv/posix shared
# memory, cuda_copy and cuda_ipc for VRAM, rc/dc/ud where a NIC exists.
FULL_TLS = "all"


def cuda_tls(tls: str) -> bool:
    """Whether UCX transport `tls` can move VRAM: the full list, or a cuda/RDMA transport."""
    return tls == FULL_TLS or tls.startswith("cuda") or tls in ("gdr_copy", "rc", "dc")


def check_tls(tls: str) -> str:
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
    stop a peer's bytes (see `nixl.py`). The UCX transport list and, when
    given, the one network interface UCX may use (`device`, as UCX's
    `NET_DEVICES`) go in as backend parameters, never through the
    environment: another library in the process may use UCX differently.
    Only UCX's log destination must be set through it (`_route_ucx_log`).
    """
    _route_ucx_log()
    engine_config = f"TLS={tls}" + (f",NET_DEVICES={device}" if device else "")
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
