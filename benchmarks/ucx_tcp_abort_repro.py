"""Force UCX's tcp teardown crash (#35.7, #29.7) every run: a peer dies between two connection set-ups.

No pdxfer engine, only the UCX objects its ucx engine makes (`lib.context`,
`lib.worker`, `lib.endpoint`; `--bare`: UCX's own tcp options instead, plus
`--ucx KEY=VALUE`). Per run, two forked processes each make a context (tls
tcp, loopback) and one worker: the peer P and the victim V. The default
schedule is the one pdxfer's handshake makes for V's sending worker: P makes
its endpoint to V first (P's inbound worker, on V's `Hello`) and progresses
it `--peer-steps` times, so its tcp connection reaches V; P stops itself
(SIGSTOP: sockets open, nothing answered); V progresses `--victim-before`
times (it accepts P's connection: a receive-only tcp endpoint); P is
SIGKILLed; then V makes its endpoint to P (V's link, on P's `Welcome`),
with `--send` posts a send on it at once, and progresses for
`--victim-after` s before closing it.

UCX 1.21, blocking tcp connect (its default): V's new endpoint takes over
P's socket, its connection request is reset, the reconnect is refused inside
`uct_tcp_ep_connect` before the endpoint has its send side, and tcp
schedules UCP's own endpoint for destruction: SIGSEGV in `close_blocking`,
or with `--send` SIGABRT in `uct_tcp_ep_pending_purge` (the hunt's stack).
A run *aborts* when V dies by a signal; it *reached* the window when V's
endpoint ended failed by UCX's error handling (exit 4 or 3 otherwise).

    .venv/bin/python benchmarks/ucx_tcp_abort_repro.py --runs 10 --send
    .venv/bin/python benchmarks/ucx_tcp_abort_repro.py --runs 10 --send --bare

Prints a line per run that aborted or missed the window, then
`runs N aborts A not-reached M`; exits 1 if any run aborted.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs (default 20)")
    p.add_argument("--first", choices=("peer", "victim"), default="peer",
                   help="which side makes its endpoint first (default peer: the crash's order)")
    p.add_argument("--peer-steps", type=int, default=50,
                   help="progress calls of the peer after making its endpoint (default 50)")
    p.add_argument("--victim-before", type=int, default=50,
                   help="progress calls of the victim before the peer is killed (default 50)")
    p.add_argument("--peer-again", type=int, default=0,
                   help="then the peer progresses this many more times before it is killed "
                        "(its UCP wireup request reaches the victim: with --victim-ep none)")
    p.add_argument("--victim-ep", choices=("before", "after", "none"), default="after",
                   help="when the victim makes its endpoint: before or after the kill, or never")
    p.add_argument("--victim-after", type=float, default=0.5,
                   help="seconds the victim progresses after the kill (default 0.5)")
    p.add_argument("--ucx", action="append", default=[], metavar="KEY=VALUE",
                   help="with --bare: a UCX context option for both sides (TCP_CONN_NB=y); repeatable")
    p.add_argument("--send", action="store_true",
                   help="the victim posts a send on its new endpoint at once (queued: SIGABRT form)")
    p.add_argument("--both", action="store_true",
                   help="odd runs without a send, even runs with one (both forms in one process)")
    p.add_argument("--bare", action="store_true",
                   help="UCX's own tcp options (with --ucx), not pdxfer's context")
    p.add_argument("--cores", default=None, help="the victim dumps core into this directory")
    a = p.parse_args(argv)
    if a.runs < 1 or min(a.peer_steps, a.victim_before, a.peer_again) < 0 or a.victim_after < 0:
        p.error("--runs must be at least 1; steps and --victim-after must not be negative")
    if a.ucx and not a.bare:
        p.error("--ucx changes UCX's own options: give it with --bare (pdxfer's context is fixed)")
    return a


def _send(fd: int, data: bytes) -> None:
    os.write(fd, len(data).to_bytes(4, "little") + data)


# bytes read past the message `_recv` returned, by fd: the next message may already be in
# the same read (a side descheduled while two messages arrive; NIXL's metadata is large)
_pending: dict[int, bytes] = {}


def _recv(fd: int, timeout: float = 30.0) -> bytes:
    buf = _pending.pop(fd, b"")
    deadline = time.monotonic() + timeout
    while True:
        if len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "little"):
            end = 4 + int.from_bytes(buf[:4], "little")
            if len(buf) > end:
                _pending[fd] = buf[end:]
            return buf[4:end]
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no answer")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError("closed")
        buf += chunk


def _side(a: argparse.Namespace, victim: bool, r: int, w: int, send: bool) -> None:
    from pdxfer.transport.ucx import lib

    ucx = lib.ucx
    if a.bare:  # UCX's own tcp defaults, as any UCXX user gets them
        config = {"TLS": "tcp", "RNDV_THRESH": "inf", "NET_DEVICES": "lo", **dict(
            item.split("=", 1) for item in a.ucx)}
        ctx = ucx.UCXContext(config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    else:  # the context pdxfer's ucx engine makes (`lib.context`)
        ctx = lib.context("tcp", "lo")
    wk = lib.worker(ctx)
    _send(w, lib.worker_address(wk))
    other = _recv(r)
    eps = []

    def connect() -> None:
        eps.append(lib.endpoint(wk, other))

    def progress(n: int) -> None:
        for _ in range(n):
            wk.progress()
            time.sleep(0.001)

    if not victim:
        if a.first == "victim":
            _recv(r)  # the victim made its endpoint
        connect()
        progress(a.peer_steps)
        _send(w, b"stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        if a.peer_again:  # continued once the victim accepted: its wireup request goes out
            progress(a.peer_again)
            _send(w, b"stopping")
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        return
    if a.first == "victim" or a.victim_ep == "before":
        connect()
        if a.first == "victim":
            _send(w, b"made")
    _recv(r)  # the peer stopped itself (after making its endpoint and progressing)
    progress(a.victim_before)
    _send(w, b"kill")
    _recv(r)  # killed
    if not eps and a.victim_ep == "after":
        connect()
    held = []
    if send and eps:
        import numpy as np

        held.append(np.zeros(1 << 16, np.uint8))
        held.append(eps[-1].tag_send(lib.Array(held[0]), lib.tag(1, 0)))
    deadline = time.monotonic() + a.victim_after
    while time.monotonic() < deadline:
        wk.progress()
        time.sleep(0.001)
    # the window was reached when the new endpoint took over the dead peer's connection and
    # UCX failed it (its error handling ran); one refused at creation never got there
    reached = bool(eps) and not any(ep.alive for ep in eps)
    for ep in eps:
        if ep.alive:
            ep.close_blocking()
    if a.victim_ep != "none" and not reached:
        os._exit(4)


def _fork(a: argparse.Namespace, victim: bool, send: bool) -> tuple[int, int, int]:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r1)
            os.close(w2)
            if victim and a.cores:
                import faulthandler
                import resource

                faulthandler.enable(all_threads=True)
                hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
                resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
                os.makedirs(a.cores, exist_ok=True)
                os.chdir(a.cores)
            _side(a, victim, r2, w1, send)
        except BaseException as exc:
            sys.stderr.write(f"{'victim' if victim else 'peer'} failed: {type(exc).__name__}: {exc}\n")
            code = 3
        finally:
            os._exit(code)
    os.close(w1)
    os.close(r2)
    return pid, r1, w2


def _stopped(pid: int) -> None:
    while True:
        done, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
        if done and os.WIFSTOPPED(status):
            return
        time.sleep(0.001)


def one_run(a: argparse.Namespace, send: bool) -> str | None:
    """One run; None if the victim lived and its endpoint failed by UCX, else what happened."""
    peer, p_r, p_w = _fork(a, False, send)
    vic, v_r, v_w = _fork(a, True, send)
    try:
        p_addr, v_addr = _recv(p_r), _recv(v_r)
        _send(v_w, p_addr)
        _send(p_w, v_addr)
        if a.first == "victim":
            _send(p_w, _recv(v_r))
        _send(v_w, _recv(p_r))  # "stopping"
        _stopped(peer)
        _recv(v_r)  # "kill"
        if a.peer_again:
            os.kill(peer, signal.SIGCONT)
            _recv(p_r)
            _stopped(peer)
        os.kill(peer, signal.SIGKILL)
        os.waitpid(peer, 0)
        _send(v_w, b"killed")
        _, status = os.waitpid(vic, 0)
        if os.WIFSIGNALED(status):
            return f"victim killed by {signal.Signals(os.WTERMSIG(status)).name}"
        if os.WEXITSTATUS(status) == 4:
            return "window not reached: the victim's endpoint did not fail"
        if os.WEXITSTATUS(status):
            return f"victim exit {os.WEXITSTATUS(status)} (not an abort; window not reached)"
        return None
    finally:
        for pid in (peer, vic):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for fd in (p_r, p_w, v_r, v_w):
            os.close(fd)
            _pending.pop(fd, None)  # the number is reused by the next run's pipes


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import pdxfer.transport.ucx.lib  # noqa: F401  (UCXX loaded before the forks)

    aborts = missed = 0
    for i in range(a.runs):
        what = one_run(a, a.send or (a.both and i % 2 == 1))
        if what is not None:
            print(f"run {i + 1}: {what}", flush=True)
            if "killed by" in what:
                aborts += 1
            else:
                missed += 1
    print(f"runs {a.runs} aborts {aborts} not-reached {missed} ({vars(a)})", flush=True)
    return 1 if aborts else 0


if __name__ == "__main__":
    sys.exit(main())
