"""What a prefill and a decode engine share: construction, the request reads, close.

Both sides own the same tree of resources — a transport engine, the pools
registered with it, a request table, one progress thread — and answer the same
non-blocking questions about a request (`poll`, `failure_reason`, `stats`) and
the same blocking one (`wait`). Those live here once; what differs (who
listens, who dials, who posts, who fences) is in `prefill.py` and `decode.py`.
So does the one call that changes the pools under traffic, `resize` (a page/
state boundary of `layout.ElasticPools`; its bookkeeping is `resizing.py`).

Lock discipline, the one rule that keeps this deadlock-free and keeps one
peer from slowing the others: the table's lock guards request state, is
taken by the drivers only through `_transition()` — which carries out what
a transition defers (control messages, fences) after releasing it, so no
message is sent and none is handled under it (#29.1) — and is held only for
local work — a state-machine transition, planning, and posting
a write on a data connection that is already open and warmed (the
transport checks the table and hands the write to its sending side, taking
only its own locks; no network wait). It is never held across a
network wait (`transport.connect`, a region lookup: those run in
`handshake.DataLinks` workers) nor while calling a transport method that
waits for another thread — `drop_peer`, `Connection.close`, `close` — because
the thread they wait for (a loopback copy worker, say) may need *our* lock to
deliver a notify before it lets such a call return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
import types
from collections.abc import Iterator, Mapping
from typing import Any

from pdxfer import layout, transport
from pdxfer.transport import closing

from . import resizing
from .clock import MONOTONIC, Clock
from .config import EngineConfig, KVPoll, RequestStats
from .errors import ClosedError, ConfigError, RequestError, RequestFailed, UnknownRequestError
from .observe import Observer, TraceEvent
from .pools import PoolSet
from .progress import Progress
from .protocol import Ping
from .requests import RequestOutcome, RequestTable, check_request_id
from .resizing import ResizeReport

log = logging.getLogger("pdxfer")


class Engine:
    """Base of `PrefillEngine` and `DecodeEngine`; not constructed directly."""

    role = "engine"

    def __init__(self, pools: Mapping[str, Any], config: EngineConfig | None = None, *,
                 clock: Clock = MONOTONIC) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        # The transport's own connect wait derives from ours unless the caller set it.
        options = {"host": config.host, "connect_timeout": config.connect_wait,
                   **config.transport_options}
        self._transport = transport.create(config.transport, **options)
        self._closed = False
        # What the transition holding the lock deferred (`_transition`); None when none does.
        self._outbox: list | None = None
        self._batches: dict[int, list] = {}
        self._closing = closing.Steps(f"{self.role} engine {self._transport.engine_id}")
        self._resizing = threading.Lock()  # one boundary move at a time
        try:
            try:
                self._pools = PoolSet(pools, self._transport)
            except transport.RegistrationError as exc:
                if config.fallback is None:
                    raise
                self._fall_back(exc)
                self._pools = PoolSet(pools, self._transport)
            # self.config, not config: after a fallback it names the transport in use
            self._observer = Observer(self.role, self.config.transport, metrics=config.metrics,
                                      traces=config.traces, levels=self._levels)
            self._table = RequestTable(self.role, self._observer)
            self._lock = self._table.lock
            self._progress = Progress(f"pdxfer-{self.role}-{self._transport.engine_id}", self._tick,
                                      clock, on_lag=self._observer.on_lag)
        except BaseException:
            self._transport.close()
            raise

    def _fall_back(self, exc: BaseException) -> None:
        """Registering with the configured transport failed: move to `config.fallback`, warn once.

        The config becomes the fallback's (default options: the failed
        backend's do not apply), so the Hello and its check carry the name
        of the transport actually in use.
        """
        failed, cfg = self._transport, self.config
        log.warning("pdxfer %s: registering the pools with transport %r failed (%s); falling back to "
                    "%r as EngineConfig.fallback allows — its peers must use %r too", self.role,
                    cfg.transport, exc, cfg.fallback, cfg.fallback)
        failed.close()
        self.config = dataclasses.replace(cfg, transport=cfg.fallback, transport_options={},
                                          fallback=None)
        self._transport = transport.create(cfg.fallback, host=cfg.host, connect_timeout=cfg.connect_wait)
        self._closing = closing.Steps(f"{self.role} engine {self._transport.engine_id}")

    # -- transitions: state under the lock, effects after it --------------------------
    @contextlib.contextmanager
    def _transition(self) -> Iterator[None]:
        """`with self._transition():` — the one way drivers change request state.

        Holds the table lock for the state machines' transitions and the
        table's bookkeeping; what those ask to be done outside (a control
        message, a fence) is queued with `_defer` and carried out once the
        lock is released, in the order queued: on the progress thread at once
        when this is it, else handed to it (#29.1). Nothing a handler of the
        loop does can then run while a transition holds the lock, and no
        handler runs in the middle of another's effects.
        """
        effects: list = []
        try:
            with self._lock:
                self._outbox, self._batches = effects, {}
                try:
                    yield
                finally:
                    self._outbox, self._batches = None, {}
        finally:  # even when the body raised: what it applied to the state already happened
            self._carry_out(effects)

    def _defer(self, fn: Any, *args: Any) -> None:
        """Queue `fn(*args)` to run once the current transition released the lock (lock held)."""
        if self._outbox is None:
            raise RuntimeError("an effect was queued outside `_transition()`: it would run under "
                               "no rule (a driver bug)")
        self._outbox.append((fn, args))

    def _defer_batch(self, fn: Any, key: Any, item: Any) -> None:
        """Like `_defer`, but one `fn(key, [items])` per `key`, where its first item was queued."""
        if self._outbox is None:
            raise RuntimeError("an effect was queued outside `_transition()` (a driver bug)")
        batch = self._batches.get(id(key))
        if batch is None:
            batch = self._batches[id(key)] = [item]
            self._outbox.append((fn, (key, batch)))
        else:
            batch.append(item)

    def _carry_out(self, effects: list) -> None:
        """Run what a transition deferred; the lock is not held here."""
        if not effects:  # also the first tick, run before the constructor has `_progress`
            return
        on_thread = self._progress.on_thread
        for fn, args in effects:
            if on_thread:
                fn(*args)
            else:
                self._progress.post(fn, *args)
        if not on_thread:
            self._progress.kick()

    # -- identity -----------------------------------------------------------
    @property
    def engine_id(self) -> str:
        """This engine's transport id: what peers see in descriptors and fence with."""
        return self._transport.engine_id

    @property
    def pool_set(self) -> PoolSet:
        """The pools this engine serves, as registered (read-only: `resize` changes them)."""
        return self._pools

    @property
    def arenas(self) -> Mapping[str, Any]:
        """Each pool's arena by name, read-only (`layout.PoolArena`, or a pool of `ElasticPools`)."""
        return types.MappingProxyType(self._pools.arenas)

    @property
    def regions(self) -> int:
        """How many allocations were registered (one per storage, however many pools share it)."""
        return len(self._pools.regions)

    # -- reads, both sides -------------------------------------------------------
    def poll(self, request_id: str) -> KVPoll:
        """Where the request stands, without blocking."""
        return self._table.poll(check_request_id(request_id))

    def wait(self, request_id: str, timeout: float | None = None) -> KVPoll:
        """Block until Success; `RequestFailed` if it failed, `TransferTimeout` past `timeout`."""
        return self._table.wait(check_request_id(request_id), timeout)

    def failure_reason(self, request_id: str) -> str | None:
        """Why the request failed (None while running or after Success)."""
        return self._table.failure_reason(check_request_id(request_id))

    def stats(self, request_id: str) -> RequestStats:
        """Bytes, segments and transfers the request moved, and how long it took."""
        return self._table.stats(check_request_id(request_id))

    def outcome(self, request_id: str) -> RequestOutcome:
        """State, failure reason, failure cause and stats, read together in one snapshot."""
        return self._table.outcome(check_request_id(request_id))

    def failure_cause(self, request_id: str) -> BaseException | None:
        """The exception behind a failure (`PeerLostError`, `TransferTimeout`, ...), or None."""
        return self._table.outcome(check_request_id(request_id)).cause

    def release(self, request_id: str) -> RequestOutcome:
        """Forget a finished request so its id can be used again; returns its final outcome."""
        return self._table.release(check_request_id(request_id))

    def try_poll(self, request_id: str) -> KVPoll | None:
        """`poll`, but None (not `UnknownRequestError`) when this engine holds no record of the id.

        For a scheduler loop that polls a request the other side may not have
        announced yet (a prefill sender before the decode's Expect arrives):
        "not yet known" is an answer there, not an error to catch.
        """
        try:
            return self.outcome(request_id).state
        except UnknownRequestError:
            return None

    def failure(self, request_id: str) -> RequestFailed | None:
        """The request's failure as the `RequestFailed` `wait` raises (cause attached), or None.

        Lets a caller raise or log the failure without blocking in `wait`:
        `raise engine.failure(rid)`.
        """
        out = self.outcome(request_id)
        if out.state is not KVPoll.Failed:
            return None
        exc = RequestFailed(request_id, out.reason or "failed")
        exc.__cause__ = out.cause
        return exc

    def usage(self) -> dict[str, int]:
        """What this engine holds now: its request records and its transport's links and memory.

        `requests` (records not yet released) plus the transport's
        `TransportEngine.usage()` — links, bounce and scratch bytes,
        registrations: the figures `pdxfer bench peers` follows as peers grow.
        """
        with self._lock:
            requests = len(self._table)
        return {"requests": requests, **self._transport.usage()}

    # -- what an operator reads (observe.py) ----------------------------------------
    @property
    def metrics(self) -> Any:
        """This engine's `prometheus_client.CollectorRegistry` (None: metrics off).

        Its own registry, so engines in one process never collide; serve it
        with `pdxfer.observe.serve_metrics` or register it where your server's
        registry collects. docs/metrics.md lists the series.
        """
        return self._observer.registry

    def trace(self, request_id: str) -> tuple[TraceEvent, ...]:
        """The request's timeline so far: `TraceEvent(t, event, detail)`s, t in seconds from its start.

        Live requests, and the last `EngineConfig.traces` finished ones (a
        ring: older ones are forgotten, `UnknownRequestError` then).
        """
        rid = check_request_id(request_id)
        with self._lock:
            events = self._observer.trace(self._table.find(rid), rid)
        if events is None:
            raise UnknownRequestError(
                f"no trace of request {rid!r} on this {self.role} engine: never seen here, "
                f"or older than the last {self.config.traces} finished (EngineConfig.traces)")
        return events

    def _levels(self) -> dict[str, Any]:
        """What the engine holds now, for a scrape (any thread; never blocks on the network)."""
        with self._lock:
            states = self._table.counts()
        links = [link for link in self._control_links() if not link.closed]
        registered: dict[str, int] = {}
        for region in self._pools.regions:
            registered[region.device] = registered.get(region.device, 0) + region.length
        return {"states": states, "links_up": self._links_up(),
                "control_backlog_bytes": sum(link.backlog for link in links),
                "control_links_stuck": sum(1 for link in links if link.stuck_since is not None),
                "registered": registered, "usage": self._usage_now()}

    def _usage_now(self) -> dict[str, int]:
        """The transport's usage, or nothing once it is closed (a scrape may come after close)."""
        if self._closed:
            return {}
        try:
            return self._transport.usage()
        except Exception:  # noqa: BLE001 — a scrape must not fail on a closing transport
            return {}

    def _control_links(self) -> list[Any]:
        """The role's control links now (read off the progress thread: a copy)."""
        return []

    def _links_up(self) -> int:
        """How many peers have a control link through its handshake now."""
        return 0

    # -- elastic pools ------------------------------------------------------------
    def resize(self, pools: layout.ElasticPools, boundary: int, used: Any, *,
               wait: float | None = None) -> ResizeReport:
        """Move the page/state boundary of `pools` (served by this engine) to `boundary`.

        `used`: the entries of the pool that shrinks whose data the caller
        keeps (`layout.plan_resize`); they are relocated and the report's
        `moved` maps their old indices to new ones. Refused (nothing moved)
        with `ResizeBlockedError` naming the requests when an unfinished
        request holds an entry the move vacates or moves one into; with
        `wait=seconds`, waits up to that long for them to finish first.
        A decode tells every prefill the new live ranges before any later
        Expect. Runs the copies under the request lock (local work, no
        network wait); call it from the scheduler, not a pdxfer callback.
        """
        names = resizing.pool_names(self._pools.arenas, pools)
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not math.isfinite(wait) or wait < 0):
            raise RequestError(f"resize wait must be a finite number of seconds >= 0, got {wait!r}")
        if wait and self._progress.on_thread:
            raise RequestError("resize(wait=...) on the progress thread would wait for itself")
        if not self._resizing.acquire(blocking=False):
            raise RequestError("another resize of this engine is running; resize one at a time")
        try:
            plan = layout.plan_resize(pools, boundary, used)  # refusals here, before anything
            report = self._resize(pools, names, plan, wait)
        finally:
            self._resizing.release()
        self._progress.kick()
        return report

    def _resize(self, pools: layout.ElasticPools, names: tuple[str, str],
                plan: layout.ResizePlan, wait: float | None) -> ResizeReport:
        started = time.monotonic()
        pool = names[0] if plan.shrinking == "page" else names[1]
        with self._lock:
            self._check_open()
            # Not only the entries `used` names: an in-flight entry the caller forgot blocks too.
            rids = resizing.blocking(self._table.running(), pool, plan) if plan.shrinking else []
            if rids and wait:
                def free() -> bool:
                    rids[:] = resizing.blocking(self._table.running(), pool, plan)
                    return not rids or self._closed
                self._table.changed.wait_for(free, wait)
                self._check_open()
            waited = time.monotonic() - started
            if rids:
                raise resizing.blocked(self.role, pool, plan, rids, wait or None)
            copy = time.perf_counter()
            moved = layout.relocate(pools, plan)
            copy_s = time.perf_counter() - copy
            for name, arena in zip(names, (pools.page, pools.state), strict=True):
                self._pools.replace(name, arena)
            self._after_resize(names)
        return ResizeReport(names, plan, moved, copy_s, waited)

    def _after_resize(self, names: tuple[str, str]) -> None:
        """Role-specific part of a resize, lock held (a decode tells its prefills)."""

    # -- lifecycle ----------------------------------------------------------
    def _check_open(self) -> None:
        """Raise `ClosedError` after close(); caller holds the lock."""
        if self._closed:
            raise ClosedError(f"{self.role} engine {self.engine_id} is closed")

    def close(self) -> None:
        """Fail what is in flight, stop the thread, release the transport. Idempotent, bounded.

        Every step runs even if an earlier one raised; the failures are raised
        once (`transport.CloseError`, naming each step), and a second `close()`
        runs again only the steps that did not finish.
        """
        with self._lock:
            self._closed = True
        if self._closing.finished:
            return

        def fail_the_rest() -> None:
            reason = f"{self.role} engine closed"
            with self._lock:  # the transport is down: nothing lands or is read any more
                for req in self._table.running():
                    req.life.on_close(reason, ClosedError(reason))
                    self._table.finish(req, False, reason, ClosedError(reason))

        self._closing.run([
            ("shut the role down", self._shutdown),
            ("stop the progress thread", lambda: self._progress.stop(self.config.shutdown_wait)),
            ("close the transport", self._transport.close),  # also ends a dial in progress
            ("join the workers", self._join_workers),
            ("fail what is still running", fail_the_rest),
        ])

    def _shutdown(self) -> None:
        """Role-specific part of close(), run before the thread stops."""

    def _join_workers(self) -> None:
        """Join the role's worker threads (bounded), once the transport is closed.

        After, not before: a worker blocked in a dial ends as soon as the
        transport's close shuts its socket, so close() does not wait out the
        dial's `connect_timeout` (#25.4).
        """

    def _tick(self, now: float) -> float:
        """Timers; returns seconds until the next wanted tick."""
        return 0.1

    @staticmethod
    def _close_links(closing: list[tuple[Any, str]]) -> None:
        """Close links `_watch` gave up on, logging why (a peer never learns it from us)."""
        for link, why in closing:
            log.warning("pdxfer: closing %s", why)
            link.close(why)

    def _watch(self, links: Any, now: float, pinging: Any) -> list[tuple[Any, str]]:
        """Ping idle links; return the ones to close: silent, or not reading for the liveness timeout.

        Progress thread. A link whose peer stopped reading has stopped reading
        that peer's input too (backpressure, `session.ControlConn`), so both show up
        here within `timeout`.
        """
        cfg, out = self.config, []
        for link in list(links):
            if link.closed:
                continue
            if link.stuck_since is not None:  # we stopped reading it: not its silence
                if now - link.stuck_since > cfg.timeout:
                    out.append((link, f"{link.label} has not read our control messages for "
                                      f"{now - link.stuck_since:.1f} s ({link.backlog} B queued; "
                                      f"timeout {cfg.timeout} s)"))
            elif not link.handshaken and now - link.opened > cfg.connect_wait:
                # a stranger that trickles bytes is never silent: bound its Hello in time too
                out.append((link, f"{link.label} sent no Hello within {cfg.connect_wait} s "
                                  "(connect_timeout)"))
            elif now - link.last_rx > cfg.timeout:  # also a peer that never says hello
                out.append((link, f"{link.label} silent for {now - link.last_rx:.1f} s "
                                  f"(timeout {cfg.timeout} s)"))
            elif pinging(link) and now - link.last_tx >= cfg.heartbeat:
                link.send(Ping())
        return out

    def _run_on_progress(self, fn: Any, timeout: float) -> bool:
        """Run `fn()` on the progress thread and wait up to `timeout` s for it; True if it ran.

        False when the loop did not get to it in time (stuck in a handler, or
        a backlog of commands): then it is logged and cancelled — a job that
        starts after its caller gave up on it would race what the caller does
        next (close() releasing the transport under it). A job already
        running when the time is up cannot be stopped; that is logged too.
        On the progress thread itself it runs inline: waiting would wait for
        itself for the whole timeout.
        """
        if self._progress.on_thread:
            fn()
            return True
        done = threading.Event()
        guard = threading.Lock()
        state = {"started": False, "cancelled": False}

        def job() -> None:
            with guard:
                if state["cancelled"]:
                    return
                state["started"] = True
            try:
                fn()
            finally:
                done.set()

        self._progress.call(job)
        if done.wait(timeout):
            return True
        with guard:
            started = state["started"]
            state["cancelled"] = not started
        log.warning("pdxfer %s: %s %s within %.1f s on the progress thread; %s", self.role,
                    getattr(fn, "__name__", fn), "did not finish" if started else "did not start",
                    timeout, "going on without it" if started else "cancelled")
        return False

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


