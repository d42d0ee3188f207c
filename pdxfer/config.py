"""What a caller configures and what it reads back: `EngineConfig`, `KVPoll`, `RequestStats`.

These three are the vocabulary a serving engine's worker speaks to us in, so
they sit apart from any machinery: a worker imports them to build a config or
branch on a poll result without pulling in sockets or threads.

`KVPoll` keeps SGLang's numbering on purpose (Failed=0 ... Success=4): a
worker ported from SGLang's `KVPoll` compares the same integers and its
scheduler's `poll == KVPoll.Success` checks keep working. `Quarantined` (5)
is ours: a decode request that failed over a transport that cannot fence,
whose entries are still not the caller's (docs/reliability.md); a scheduler
that knows only SGLang's values sees an unfinished request and keeps waiting.

Every timing knob derives from one number, `timeout`, unless the caller sets
it explicitly; the derivation is written once, here, in `EngineConfig`'s
properties, and the engines ask for it rather than recomputing it.
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


class KVPoll(enum.IntEnum):
    """Where a request stands; the values are SGLang's so ported code compares the same ints."""

    Failed = 0
    Bootstrapping = 1  # no peer for it yet: handshake running, or the other side has not spoken
    WaitingForInput = 2  # both sides know it; waiting for prefill to send
    Transferring = 3  # bytes are in flight
    Success = 4  # every byte of every chunk through the last has landed
    # Failed, but the prefill may still be writing into its entries and the
    # transport cannot fence it: not finished, entries not the caller's yet (#11)
    Quarantined = 5

    @property
    def finished(self) -> bool:
        """Success or Failed: the request's entries belong to the caller again."""
        return self in (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine reaches its peers and how long it waits for them.

    Two different waits, on purpose:

    - `timeout` is the *liveness* timeout: a peer whose control link stays
      silent this long (heartbeats go every `heartbeat`) is lost, and every
      request to it fails. A dead or stalled peer therefore fails its
      requests within about `timeout + abort_grace` seconds, whatever
      `request_timeout` says.
    - `request_timeout` (default: `timeout`) is the *per-request* wait: how
      long a request may make no progress (no Expect for a sent request, no
      chunk for an expected one, no confirmation of its last chunk) while its
      peer is alive. A serving deployment whose prefill queue can hold a
      request for minutes raises it without slowing fault detection.

    `connect_timeout` (default: `timeout`) bounds opening a data connection:
    the transport's dial and handshake and the first region lookup. It is
    also how long a decode keeps trying to reach a prefill it has never
    reached (a decode started first, a name not resolvable yet): the
    bootstrap host is resolved off the progress thread and redialled with
    backoff (50 ms doubling to 1 s) until `connect_timeout` has passed since
    the first dial; then its requests fail as "not reached" (a request whose
    `request_timeout` ends first fails so too; an address whose prefill was
    reached and then lost is not redialled). Every other wait (close,
    abort grace) derives from these; see the properties.

    Durations must be finite and positive: NaN would silently disable every
    timeout (no comparison with NaN is ever true) and `inf` would make a dead
    peer's requests wait forever, so both are refused; "very long" is a large
    number (1e6 s is eleven days). `transport_options` are the backend's own
    constructor options (`transport.registry.options(name)` lists them): an
    unknown key, `host` (that is `EngineConfig.host`), or an option the
    backend accepts but ignores (loopback's port/streams, nixl's and verbs'
    streams) is
    refused rather than silently dropped.

    `fallback` (e.g. "tcp"): the transport to use when registering the pools
    with `transport` fails (`transport.RegistrationError`: GPU memory the NIC
    cannot register — no nvidia_peermem, no dma-buf — or a memlock limit
    too low). The engine then runs on `fallback`, with its default options,
    logs one warning naming the cause, and its `config.transport` says so;
    its peers must use that transport too (the handshake refuses a
    mismatch by name). None (the default): the failure is raised.

    `metrics`: Prometheus series in the engine's own registry
    (`engine.metrics`, docs/metrics.md) — None (default) when
    `prometheus_client` is installed, True to require it (`ConfigError`
    without it), False for none. `traces`: how many finished requests'
    timelines `engine.trace(rid)` keeps (a ring; 0: no traces at all).
    """

    transport: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 0  # the prefill side's control listener; 0 picks a free port
    timeout: float = 10.0
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    heartbeat_interval: float | None = None  # None: timeout / 4
    abort_grace: float | None = None  # None: min(1 s, timeout / 2)
    request_timeout: float | None = None  # None: timeout
    connect_timeout: float | None = None  # None: timeout
    fallback: str | None = None  # transport to use if registering the pools fails; None: raise
    metrics: bool | None = None  # None: on when prometheus_client is installed
    traces: int = 1024  # finished requests' timelines kept for trace(); 0: none

    def __post_init__(self) -> None:
        _validate(self)
        # Frozen means frozen: a dict the caller keeps could change under us.
        object.__setattr__(self, "transport_options", types.MappingProxyType(dict(self.transport_options)))

    @property
    def heartbeat(self) -> float:
        """Seconds between pings on an idle control link."""
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.timeout / 4

    @property
    def grace(self) -> float:
        """How long an aborting side waits for the peer's ack before fencing it."""
        return self.abort_grace if self.abort_grace is not None else min(1.0, self.timeout / 2)

    @property
    def request_wait(self) -> float:
        """How long a request may make no progress while its peer is alive."""
        return self.request_timeout if self.request_timeout is not None else self.timeout

    @property
    def connect_wait(self) -> float:
        """Bound on opening a data connection (dial, handshake, first region lookup)."""
        return self.connect_timeout if self.connect_timeout is not None else self.timeout

    @property
    def bootstrap_wait(self) -> float:
        """Bound on a peer's whole bootstrap: the control handshake plus the data connection."""
        return self.timeout + self.connect_wait

    @property
    def shutdown_wait(self) -> float:
        """Bound on each step of close(): draining transfers, the progress thread's last turn."""
        return self.grace + min(self.timeout, self.connect_wait)

    def __hash__(self) -> int:  # the mapping proxy is unhashable; hash what identifies the config
        options = tuple(sorted((k, repr(v)) for k, v in self.transport_options.items()))
        return hash((self.transport, self.host, self.port, self.timeout, options,
                     self.heartbeat_interval, self.abort_grace, self.request_timeout,
                     self.connect_timeout, self.fallback, self.metrics, self.traces))


def _validate(cfg: EngineConfig) -> None:
    """Every field check of `EngineConfig`, in one place: `ConfigError` naming the field and the fix."""
    if not isinstance(cfg.transport, str) or not cfg.transport:
        raise ConfigError(f"EngineConfig.transport must be a backend name, got {cfg.transport!r}")
    if cfg.fallback is not None and (not isinstance(cfg.fallback, str) or not cfg.fallback
                                     or cfg.fallback == cfg.transport):
        raise ConfigError(f"EngineConfig.fallback must be None or another backend's name than "
                          f"transport {cfg.transport!r} (e.g. 'tcp'), got {cfg.fallback!r}")
    if not isinstance(cfg.host, str):
        raise ConfigError(f"EngineConfig.host must be a host name or address string, got {cfg.host!r}")
    # bool is an int: port=True would bind port 1
    if isinstance(cfg.port, bool) or not isinstance(cfg.port, int) or not 0 <= cfg.port <= 65535:
        raise ConfigError(f"EngineConfig.port must be an int 0..65535, got {cfg.port!r}")
    for name in ("timeout", "heartbeat_interval", "abort_grace", "request_timeout",
                 "connect_timeout"):
        value = getattr(cfg, name)
        if value is None and name != "timeout":
            continue
        # an int past float's range (10**400) makes isfinite raise OverflowError: check its size
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, int) and value.bit_length() > 1000)
                or not math.isfinite(value) or value <= 0):
            raise ConfigError(
                f"EngineConfig.{name} must be a finite, positive number of seconds, got {value!r:.60}"
                + ("; for 'no limit' pass a large number such as 1e6" if value == math.inf else "")
            )
    if cfg.metrics is not None and not isinstance(cfg.metrics, bool):
        raise ConfigError(f"EngineConfig.metrics must be True, False or None (on when "
                          f"prometheus_client is installed), got {cfg.metrics!r:.60}")
    if isinstance(cfg.traces, bool) or not isinstance(cfg.traces, int) or not 0 <= cfg.traces <= 1 << 24:
        raise ConfigError(f"EngineConfig.traces must be an int 0..{1 << 24} (finished requests' "
                          f"timelines kept; 0: none), got {cfg.traces!r:.60}")
    if not isinstance(cfg.transport_options, Mapping):
        raise ConfigError(f"EngineConfig.transport_options must be a mapping, got {cfg.transport_options!r}")
    if not cfg.transport_options:
        return
    from pdxfer import transport  # here: a config without options never loads a backend

    try:
        used, ignored = transport.registry.options(cfg.transport)
    except transport.CapabilityError:
        return  # the backend is absent: creating the engine says so, with the install hint
    for key in cfg.transport_options:
        if key == "host":
            raise ConfigError("transport_options['host'] duplicates EngineConfig.host; set that instead")
        if key in ignored:
            raise ConfigError(
                f"transport {cfg.transport!r} ignores the option {key!r}; drop it "
                f"(its options: {', '.join(sorted(used - {'host'}))})"
            )
        if key not in used:
            raise ConfigError(
                f"unknown transport_options key {key!r} for transport {cfg.transport!r}; "
                f"valid: {', '.join(sorted(used - {'host'}))}"
            )


@dataclass(frozen=True)
class RequestStats:
    """What one request cost: bytes moved, segments and transfers posted, seconds it took.

    On the decode side the counts come from the prefill's notify payloads —
    decode posts nothing itself — so both sides report the same numbers.
    `elapsed_s` runs from `send`/`expect` to the finish (or to now if running).

    `wire_s` is the time on the wire alone, apart from queueing and
    handshakes: on the prefill (which posts), from its first write posted to
    its last write complete in the decode's memory (the transport's
    completion time, not when a poll saw it); on the decode, which sees only
    arrivals, from its first transfer landed to its last (so 0 for a
    one-transfer request). 0 until a write was posted / landed.
    """

    nbytes: int
    segments: int
    transfers: int
    elapsed_s: float
    wire_s: float = 0.0
