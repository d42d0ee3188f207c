"""No control message is handled inside a send, and no send runs under the table lock (#29.1).

A control link stuck past `MAX_BACKLOG` stops reading its peer; frames it had
already read wait in its input buffer. The send that drains it back under
half the bound must not handle them there and then: the caller of `send` may
hold the request table's lock (a driver carrying out a Done, an Abort) and
the handler takes that same lock — the progress thread would wait for itself
and `close()` after it, forever. The waits here are bounded, so today's code
fails instead of hanging.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
from pdxfer_testkit import build_pools, config

import pdxfer.requests as requests_mod
from pdxfer import DecodeEngine, KVPoll, PrefillEngine
from pdxfer.progress import Progress
from pdxfer.protocol import CONTROL, Done, Expect, Ping, pack_indices
from pdxfer.session import MAX_BACKLOG, ControlConn

WAIT = 10.0


class _GatedSocket:
    """A socket whose sends are refused (EAGAIN) until `open`, then taken whole (and dropped).

    The selector sees the real socket, whose own send buffer the test keeps
    full: the loop is not woken for writing while the gate is shut, so the
    only flush that drains the backlog is the one inside the test's `send`.
    """

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.open = False

    def fileno(self) -> int:
        return self.real.fileno()

    def send(self, data) -> int:
        if not self.open:
            raise BlockingIOError
        return len(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _fill(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.send(b"\0" * 65536)
    except BlockingIOError:
        pass


def test_a_drained_backlog_never_handles_input_inside_the_send() -> None:
    progress = Progress("pdxfer-test-reentry", lambda now: 1.0)
    ours, theirs = socket.socketpair()
    _fill(ours)  # the real socket is never writable: no write event races the test's send
    gated = _GatedSocket(ours)
    table_lock = threading.Lock()  # stands for the request table's lock
    stuck, handled = threading.Event(), threading.Event()
    seen: dict = {}
    in_send = threading.Event()
    big = Expect("big", 1, {"kv": pack_indices(np.zeros(MAX_BACKLOG // 8 // 5, np.int64))})
    made: dict = {}

    def on_message(link, msg) -> None:
        if isinstance(msg, Ping):  # the first frame: answer with more than the bound
            for _ in range(6):
                link.send(big)
            assert link.stuck_since is not None
            stuck.set()
        elif isinstance(msg, Done):  # the second frame, read with the first, held back
            seen["inside_send"] = in_send.is_set()
            # A handler takes the table lock, as the drivers' Abort/AbortAck/Expect handlers do.
            seen["locked"] = table_lock.acquire(timeout=1.0)
            if seen["locked"]:
                table_lock.release()
            handled.set()

    def make() -> None:
        made["link"] = ControlConn(gated, progress, "test peer", on_message, lambda *a: None)
        made["ready"] = True

    try:
        progress.call(make)
        theirs.sendall(CONTROL.pack(Ping()) + CONTROL.pack(Done("r", 1)))
        assert stuck.wait(WAIT), "the link never went past MAX_BACKLOG"
        link = made["link"]
        assert link.backlog > MAX_BACKLOG and not handled.is_set()
        sent = threading.Event()

        def driver() -> None:  # a driver sending while it holds the table lock
            with table_lock:
                gated.open = True
                in_send.set()
                link.send(Ping())  # drains the backlog to zero: the link resumes reading
                in_send.clear()
            sent.set()

        progress.call(driver)
        assert sent.wait(WAIT), "the driver's send never returned"
        assert handled.wait(WAIT), "the held-back frame was never handled after the link resumed"
        assert seen == {"inside_send": False, "locked": True}, (
            f"the held-back frame was handled inside the send, under the caller's lock: {seen}")
    finally:
        progress.call(lambda: made.get("link") and made["link"].close("test over"))
        progress.stop(WAIT)
        theirs.close()


class _OwnedLock:
    """A plain lock that knows which thread holds it (for the table, in the test below)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_here(self) -> bool:
        return self.owner == threading.get_ident()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:  # for threading.Condition
        return self.held_here()


def test_no_control_message_is_sent_holding_the_table_lock(monkeypatch) -> None:
    locks: list[_OwnedLock] = []

    class _Threading:
        Condition = threading.Condition

        @staticmethod
        def Lock() -> _OwnedLock:  # noqa: N802 — stands in for threading.Lock
            lock = _OwnedLock()
            locks.append(lock)
            return lock

    monkeypatch.setattr(requests_mod, "threading", _Threading)
    sends: list[tuple[str, bool]] = []
    real_send = ControlConn.send

    def send(self, msg) -> None:
        sends.append((type(msg).__name__, any(lock.held_here() for lock in locks)))
        real_send(self, msg)

    monkeypatch.setattr(ControlConn, "send", send)
    src, dst = build_pools(64, 16, seed=1), build_pools(64, 16, seed=2)
    prefill = PrefillEngine(src, config("loopback"))
    decode = DecodeEngine(dst, config("loopback"))
    try:
        assert len(locks) == 2
        idx = {"kv": np.arange(4), "state": np.array([1])}
        decode.expect("ok", prefill.bootstrap_address, idx)
        prefill.send("ok", idx)
        assert decode.wait("ok", WAIT) is KVPoll.Success
        decode.expect("gone", prefill.bootstrap_address, {"kv": np.arange(4, 8), "state": [2]})
        decode.abort("gone")  # an Abort from the caller's thread, an AbortAck back
        for rid in ("gone",):
            try:
                decode.wait(rid, WAIT)
            except Exception:  # noqa: BLE001 — failed is the expected end
                pass
    finally:
        decode.close()
        prefill.close()
    kinds = {kind for kind, _ in sends}
    assert {"Hello", "Welcome", "Expect", "Done"} <= kinds, kinds
    under = [kind for kind, locked in sends if locked]
    assert not under, f"control messages sent holding the table lock: {under}"


def test_run_on_progress_gives_up_at_its_timeout_and_cancels_the_job() -> None:
    """A job the loop did not start within the timeout never runs after its caller moved on."""
    engine = PrefillEngine(build_pools(16, 4, seed=1), config("loopback"))
    gate, blocked, ran = threading.Event(), threading.Event(), threading.Event()

    def block() -> None:  # a handler stuck on the progress thread
        blocked.set()
        gate.wait(WAIT)

    try:
        engine._progress.call(block)
        assert blocked.wait(WAIT)
        assert engine._run_on_progress(ran.set, 0.2) is False
        gate.set()
        turned = threading.Event()  # queued behind the cancelled job: the loop has passed it
        engine._progress.call(turned.set)
        assert turned.wait(WAIT)
        assert not ran.is_set(), "a job cancelled at its timeout still ran afterwards"
        assert engine._run_on_progress(ran.set, WAIT) is True and ran.is_set()
    finally:
        gate.set()
        engine.close()
