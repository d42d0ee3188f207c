"""What an engine tells an operator: Prometheus metrics and per-request traces (#32).

One `Observer` per engine, made by `Engine.__init__` and handed to the few
places where the facts are born, so each is counted once:

- the request table (`requests.RequestTable`): every caller-visible state
  change (add, advance, quarantine, finish) goes through it — that is where
  outcomes, failure reasons, end-to-end and wire time are counted and where
  a trace records each state;
- the drivers' effects (`prefill._apply`, `decode._apply`): each control
  message a transition sends (Expect, Done, Abort, AbortAck);
- the data path: each write posted (`chunks.post_parts`), each notify
  landed (`decode._apply_landed`);
- the links: handshakes done, refused, lost, and the decode's dials.

Everything that is a level rather than an event (requests in flight by
state, links up, registered bytes, control backlog, the transport's bounce
and scratch use) is read when Prometheus scrapes, by a collector calling the engine's
`levels` (`Engine._levels`): it costs the hot path nothing.

Metrics use `prometheus_client` (the ecosystem's library, the optional
`metrics` extra), one `CollectorRegistry` per engine, so several engines in
one process never collide; nothing is served from here — a launcher or the
CLI exposes `Observer.registry` (`serve_metrics`). Without the package,
metrics are off and the calls below cost one attribute test.

Traces are always kept (unless `EngineConfig(traces=0)`): a running
request's events on its record, bounded per request, and the timelines of
the last `traces` finished requests in a ring, so memory does not grow with
traffic. `Engine.trace(rid)` returns one; each event is also a structured
DEBUG log line on the `pdxfer.trace` logger. Once a launcher calls
`enable_spans` (an OpenTelemetry tracer provider with an exporter), each
finished request also becomes one span carrying its timeline as span events,
built and exported on a thread of its own — never under an engine's lock.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from pdxfer.transport.errors import (
    CapabilityError,
    ClosedError,
    PeerLostError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)

from .config import KVPoll
from .errors import ConfigError, LayoutError, LayoutMismatchError, RequestError

__all__ = ["EVENTS_PER_REQUEST", "REASONS", "Observer", "TraceEvent", "disable_spans",
           "enable_spans", "failure_kind", "metrics_available", "serve_metrics"]

log = logging.getLogger("pdxfer.trace")

# Events kept per running request; past it only its final events are (a request of
# thousands of chunks must not hold thousands of tuples).
EVENTS_PER_REQUEST = 256

# Failure reasons, the `reason` label of `pdxfer_request_failures_total`: a fixed set,
# so a label never carries a request id or an address (cardinality stays bounded).
REASONS = ("peer_lost", "timeout", "layout_refused", "aborted_prefill", "aborted_decode",
           "closed", "protocol", "refused", "transport", "other")

# Seconds: a request's wire and end-to-end time span tens of microseconds (one
# page on loopback) to tens of seconds (a stalled peer hitting its timeout).
TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TraceEvent(NamedTuple):
    """One event of a request's timeline: seconds since the request began, what, details."""

    t: float
    event: str
    detail: str


def _text(detail: Any) -> str:
    """An event's detail as text: a str as it is, `(format, *args)` formatted."""
    return detail if isinstance(detail, str) else detail[0].format(*detail[1:])


def metrics_available() -> bool:
    """Whether `prometheus_client` imports here (`pip install 'pdxfer[metrics]'`)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def failure_kind(role: str, reason: str | None, error: BaseException | None) -> str:
    """The `reason` label of a failure: what caused it, from one of `REASONS`.

    Decided from the exception's class first (the engine raises a class per
    cause), then from who aborted: an abort carries no exception on the side
    that asked for it and a plain `RequestError` on the side that was told.
    """
    text = reason or ""
    if isinstance(error, TransferTimeout):
        return "timeout"
    if isinstance(error, (LayoutMismatchError, LayoutError)) or "layout mismatch" in text:
        return "layout_refused"
    if isinstance(error, PeerLostError):
        return "peer_lost"
    if isinstance(error, ClosedError):
        return "closed"
    if isinstance(error, ProtocolError):
        return "protocol"
    if isinstance(error, CapabilityError):
        return "refused"
    if isinstance(error, TransportError):
        return "transport"
    if text.startswith("aborted by prefill"):
        return "aborted_prefill"
    if text.startswith("aborted by decode"):
        return "aborted_decode"
    if error is None or type(error) is RequestError:
        # the other side's word: its abort, its timeout, its refusal of the id
        return "aborted_decode" if role == "prefill" else "aborted_prefill"
    return "other"


class _Hist:
    """A histogram's buckets and sum, as plain numbers (the exposition is built at scrape)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: past every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        fam = HistogramMetricFamily(name, doc, labels=labels)
        fam.add_metric(values, self.buckets(), self.sum)
        return fam

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class _Metrics:
    """One engine's counts, as plain numbers, and the registry that exposes them.

    Written only under the engine's table lock (requests) or on its
    progress thread (links, lag): an increment is an attribute add, not a
    metrics library's locked call — the hot path's cost is what #32 bounds.
    Prometheus reads them through `_Collector` at scrape time; a count read
    mid-update is at most one event behind.
    """

    def __init__(self, role: str, backend: str, levels: Callable[[], dict]) -> None:
        from prometheus_client import CollectorRegistry

        self.role, self.backend = role, backend
        self.started = self.succeeded = self.failed = 0
        self.nbytes = self.segments = self.transfers = self.quarantined = 0
        self.failures: dict[tuple[str, str], int] = {}
        self.links: dict[tuple[str, str], int] = {}
        self.wire = _Hist(TIME_BUCKETS)
        self.e2e_ok, self.e2e_failed = _Hist(TIME_BUCKETS), _Hist(TIME_BUCKETS)
        self.quarantine_s = _Hist(TIME_BUCKETS)
        self.lag = _Hist(LAG_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self, levels))


class _Collector:
    """What Prometheus reads: the counts of `_Metrics`, and the engine's levels now."""

    def __init__(self, m: _Metrics, levels: Callable[[], dict]) -> None:
        self._m, self._levels = m, levels

    def describe(self) -> list:
        return []  # unchecked: the names are fixed here, and a describe must not run `levels`

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self._m
        base, names = [m.role, m.backend], ["role", "backend"]

        def counter(name: str, doc: str, value: float) -> Any:
            fam = CounterMetricFamily(name, doc, labels=names)
            fam.add_metric(base, value)
            return fam

        yield counter("pdxfer_requests_started", "Requests this engine began tracking "
                      "(send/expect, or a decode's Expect on a prefill)", m.started)
        done = CounterMetricFamily("pdxfer_requests", "Requests finished, by outcome "
                                   "(success, failed)", labels=[*names, "outcome"])
        done.add_metric([*base, "success"], m.succeeded)
        done.add_metric([*base, "failed"], m.failed)
        yield done
        fails = CounterMetricFamily("pdxfer_request_failures", "Failed requests by cause "
                                    "(reason) and the state they had reached (phase)",
                                    labels=[*names, "reason", "phase"])
        for (reason, phase), n in sorted(dict(m.failures).items()):
            fails.add_metric([*base, reason, phase], n)
        yield fails
        yield counter("pdxfer_bytes", "Bytes moved by finished requests (prefill: posted; "
                      "decode: landed)", m.nbytes)
        yield counter("pdxfer_segments", "Contiguous byte ranges moved by finished requests",
                      m.segments)
        yield counter("pdxfer_transfers", "Transfers (one per pool per chunk) of finished "
                      "requests", m.transfers)
        yield m.wire.family("pdxfer_request_wire_seconds", "Time on the wire of each "
                            "successful request (RequestStats.wire_s)", names, base)
        e2e = m.e2e_ok.family("pdxfer_request_seconds", "send/expect to the finish, by outcome",
                              [*names, "outcome"], [*base, "success"])
        e2e.add_metric([*base, "failed"], m.e2e_failed.buckets(), m.e2e_failed.sum)
        yield e2e
        yield counter("pdxfer_requests_quarantined", "Requests that entered Quarantined "
                      "(failed, entries not free: no fence)", m.quarantined)
        yield m.quarantine_s.family("pdxfer_quarantine_seconds", "How long each quarantined "
                                    "request stayed so", names, base)
        links = CounterMetricFamily("pdxfer_links", "Control links by event: opened (handshake "
                                    "done), lost, refused (with kind), dialed (decode: each "
                                    "connect attempt)", labels=[*names, "event", "kind"])
        for (event, kind), n in sorted(dict(m.links).items()):
            links.add_metric([*base, event, kind], n)
        yield links
        yield m.lag.family("pdxfer_progress_lag_seconds", "How late the progress loop ran its "
                           "timers (a loop blocked by a handler shows here)", names, base)

        now = self._levels()
        inflight = GaugeMetricFamily("pdxfer_requests_in_flight", "Unfinished requests by state",
                                     labels=[*names, "state"])
        for state in KVPoll:
            if not state.finished:
                inflight.add_metric([*base, state.name], now["states"].get(state, 0))
        yield inflight
        for name, doc in (("links_up", "Control links with a finished handshake"),
                          ("control_backlog_bytes", "Control bytes queued to peers, unsent"),
                          ("control_links_stuck", "Control links whose peer stopped reading")):
            g = GaugeMetricFamily(f"pdxfer_{name}", doc, labels=names)
            g.add_metric(base, now[name])
            yield g
        reg = GaugeMetricFamily("pdxfer_registered_bytes", "Memory registered with the transport",
                                labels=[*names, "device"])
        for device, nbytes in sorted(now["registered"].items()):
            reg.add_metric([*base, device], nbytes)
        yield reg
        use = GaugeMetricFamily("pdxfer_transport_usage", "The transport's own counts and bytes "
                                "(TransportEngine.usage(): links_out/in, bounce_bytes, "
                                "device_scratch_bytes, ...)", labels=[*names, "key"])
        for key, value in sorted(now["usage"].items()):
            use.add_metric([*base, key], value)
        yield use


class Observer:
    """One engine's metrics (or none) and request traces; see the module docstring.

    Every `on_*` method is called with the table lock held (or on the
    progress thread, for links), so none blocks and none takes a lock of
    its own besides the metrics library's.
    """

    def __init__(self, role: str, backend: str, *, metrics: bool | None, traces: int,
                 levels: Callable[[], dict]) -> None:
        self.role, self._backend = role, backend
        if metrics is None:
            metrics = metrics_available()
        elif metrics and not metrics_available():
            raise ConfigError("EngineConfig.metrics=True needs prometheus_client, which is not "
                              "installed; `pip install 'pdxfer[metrics]'`, or pass metrics=None "
                              "(on when installed) or False")
        self._m = _Metrics(role, backend, levels) if metrics else None
        self._keep = traces
        # Finished timelines, newest last: appending is the hot path (one C call, the oldest
        # dropped by maxlen); `trace()` scans it, which only a reader pays for.
        self._ring: collections.deque[tuple[str, float, list]] = collections.deque(
            maxlen=max(1, traces))
        self._held: dict[int, float] = {}  # id(request) -> when it was quarantined
        self._debug = False  # the `pdxfer.trace` logger logs DEBUG (as of the last request begun)

    @property
    def registry(self) -> Any:
        """This engine's `prometheus_client.CollectorRegistry`, or None with metrics off."""
        return self._m.registry if self._m is not None else None

    # -- the request table (lock held) --------------------------------------------
    def on_added(self, req: Any) -> None:
        if self._keep:
            req.trace = []
            # asked once per request, not per event: a level set now shows from the next request
            self._debug = log.isEnabledFor(logging.DEBUG)
        if self._m is not None:
            self._m.started += 1

    def on_state(self, req: Any, state: KVPoll) -> None:
        self.event(req, "state", state.name)

    def on_quarantined(self, req: Any, reason: str) -> None:
        self.event(req, "quarantined", reason, final=True)
        if self._m is not None and id(req) not in self._held:
            self._held[id(req)] = time.monotonic()
            self._m.quarantined += 1

    def on_finished(self, req: Any) -> None:
        ok = req.state is KVPoll.Success
        self.event(req, "success" if ok else "failed", "" if ok else (req.reason or ""), final=True)
        if req.trace is not None:
            self._ring.append((req.id, req.started, req.trace))
        spans = _spans
        if spans is not None:
            spans.put((self.role, self._backend, req.id, req.started, req.ended, ok, req.reason,
                       req.nbytes, req.segments, req.trace))
        m = self._m
        if m is None:
            return
        elapsed = req.ended - req.started
        if ok:
            m.succeeded += 1
            m.e2e_ok.observe(elapsed)
            if req.wire_from is not None:
                m.wire.observe(max(0.0, (req.wire_to or req.ended) - req.wire_from))
        else:
            m.failed += 1
            m.e2e_failed.observe(elapsed)
            key = (failure_kind(self.role, req.reason, req.error),
                   getattr(req.life, "seen", req.state).name)
            m.failures[key] = m.failures.get(key, 0) + 1
        m.nbytes += req.nbytes
        m.segments += req.segments
        m.transfers += req.transfers
        if self._held:
            held = self._held.pop(id(req), None)
            if held is not None:
                m.quarantine_s.observe(req.ended - held)

    # -- events (lock held, or the record is the caller's) -----------------------
    def event(self, req: Any, event: str, detail: Any = "", *, final: bool = False) -> None:
        """Append one event to the request's trace (and log it at DEBUG).

        `detail`: a str, or `(format, *args)` formatted only when read — a
        posted write's numbers cost a tuple here, not a string.
        """
        trace = req.trace
        if trace is None:
            return
        if len(trace) >= EVENTS_PER_REQUEST and not final:
            if len(trace) == EVENTS_PER_REQUEST:  # said once; later events until the end dropped
                trace.append((time.monotonic(), "truncated",
                              f"more than {EVENTS_PER_REQUEST} events; only the final ones kept"))
            return
        now = time.monotonic()
        trace.append((now, event, detail))
        if self._debug:
            text = _text(detail)
            log.debug("pdxfer trace role=%s request=%r t=%.6f event=%s %s", self.role, req.id,
                      now - req.started, event, text,
                      extra={"pdxfer_trace": {"role": self.role, "request": req.id,
                                              "t": now - req.started, "event": event,
                                              "detail": text}})

    def trace(self, req: Any, rid: str) -> tuple[TraceEvent, ...] | None:
        """The timeline of `req` (a live record, or None) or of a finished `rid`; lock held."""
        if req is not None and req.trace is not None:
            started, events = req.started, req.trace
        else:
            found = next((k for k in reversed(self._ring) if k[0] == rid), None)  # newest first
            if found is None:
                return None
            _, started, events = found
        return tuple(TraceEvent(t - started, e, _text(d)) for t, e, d in list(events))

    # -- links and the loop (progress thread) ---------------------------------------
    def on_link(self, event: str, kind: str = "") -> None:
        """A control link `event`: opened, lost, refused (`kind`: layout, transport, ...), dialed."""
        if self._m is not None:
            self._m.links[(event, kind)] = self._m.links.get((event, kind), 0) + 1

    def on_lag(self, late: float) -> None:
        """The progress loop ran a due tick `late` seconds after it was due."""
        if self._m is not None:
            self._m.lag.observe(late)


def serve_metrics(registries: Any, port: int, host: str = "127.0.0.1") -> tuple[Any, int]:
    """Serve the registries' series over HTTP (`/metrics`) on a daemon thread: `(server, port)`.

    For launchers and the CLI; the library never serves anything itself.
    `registries`: one registry (`engine.metrics`) or several (a process
    running a prefill and a decode), merged into one page. Port 0 picks a
    free one, returned. `server.shutdown()` stops it.
    """
    if not metrics_available():
        raise ConfigError("serving metrics needs prometheus_client, which is not installed; "
                          "`pip install 'pdxfer[metrics]'`")
    from prometheus_client import CollectorRegistry, start_http_server

    regs = [registries] if not isinstance(registries, (list, tuple)) else list(registries)
    regs = [r for r in regs if r is not None]
    if not regs:
        raise ConfigError("no metrics to serve: the engine was built with EngineConfig("
                          "metrics=False); build it with metrics=True")
    if len(regs) == 1:
        registry = regs[0]
    else:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(regs))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_address[1]


class _Merged:
    """Several registries' series as one page: a family two engines both export is listed once."""

    def __init__(self, registries: list) -> None:
        self._registries = registries

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        families: dict[str, Any] = {}
        for registry in self._registries:
            for family in registry.collect():
                have = families.get(family.name)
                if have is None:
                    have = Metric(family.name, family.documentation, family.type, family.unit)
                    have.samples = list(family.samples)
                    families[family.name] = have
                else:
                    have.samples.extend(family.samples)
        return iter(families.values())


# -- OpenTelemetry (optional) -----------------------------------------------------------
class _Spans:
    """Finished requests as OpenTelemetry spans, built and ended on a daemon thread of its own.

    The engines only append to a bounded deque (the oldest dropped, and
    counted, if the exporter falls behind): a span processor that exports
    synchronously may wait on the network, which must never happen under an
    engine's lock or on its progress thread.
    """

    LIMIT = 8192

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        self._queue: collections.deque = collections.deque(maxlen=self.LIMIT)
        self._wake = threading.Event()
        self._stop = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="pdxfer-spans", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        if len(self._queue) == self.LIMIT:
            self.dropped += 1
        self._queue.append(item)
        self._wake.set()

    def close(self, timeout: float) -> None:
        """Export what is queued, then end the thread (bounded by `timeout`)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._queue:
                try:
                    self._emit(*self._queue.popleft())
                except Exception:  # an exporter's bug must not end the thread
                    log.exception("pdxfer: exporting a request span failed")
            if self._stop:
                return

    def _emit(self, role: str, backend: str, rid: str, started: float, ended: float, ok: bool,
              reason: str | None, nbytes: int, segments: int, trace: list | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        to_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> the wall clock spans use
        attrs = {"pdxfer.role": role, "pdxfer.backend": backend, "pdxfer.request_id": rid,
                 "pdxfer.outcome": "success" if ok else "failed", "pdxfer.bytes": nbytes,
                 "pdxfer.segments": segments}
        if reason:
            attrs["pdxfer.reason"] = reason
        span = self._tracer.start_span(f"pdxfer.{role}.request", attributes=attrs,
                                       start_time=int(started * 1e9) + to_ns)
        for t, event, detail in list(trace or ()):
            span.add_event(event, {"detail": _text(detail)}, timestamp=int(t * 1e9) + to_ns)
        if not ok:
            span.set_status(Status(StatusCode.ERROR, reason or "failed"))
        span.end(end_time=int(ended * 1e9) + to_ns)


_spans: _Spans | None = None
_spans_lock = threading.Lock()


def enable_spans(tracer_provider: Any = None) -> None:
    """Export each finished request as an OpenTelemetry span, from every engine in this process.

    For a launcher that has configured an exporter: `tracer_provider` (None:
    OpenTelemetry's global one). One span per request and side,
    `pdxfer.prefill.request` / `pdxfer.decode.request`, from its start to
    its finish, with its trace's events (`Engine.trace`) as span events and
    its outcome, reason and bytes as attributes. Needs `opentelemetry-api`;
    `disable_spans` stops it.
    """
    global _spans
    try:
        from opentelemetry import trace as otel
    except ImportError:
        raise ConfigError("enable_spans needs OpenTelemetry: pip install opentelemetry-api "
                          "(and an SDK with an exporter, e.g. opentelemetry-sdk)") from None
    tracer = otel.get_tracer("pdxfer", tracer_provider=tracer_provider)
    with _spans_lock:
        old, _spans = _spans, _Spans(tracer)
    if old is not None:
        old.close(5.0)


def disable_spans(timeout: float = 5.0) -> None:
    """Stop exporting spans; what was queued is exported first (bounded by `timeout`)."""
    global _spans
    with _spans_lock:
        old, _spans = _spans, None
    if old is not None:
        old.close(timeout)
