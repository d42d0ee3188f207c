"""Force the nixl backend into UCX's tcp teardown window: a peer dies between two connection set-ups.

The schedule of `ucx_tcp_abort_repro.py` (which kills the victim every run
under UCX 1.21's blocking tcp connect, see docs/reliability.md "Forced every
run"), on the agents pdxfer's nixl engine makes (`agent.make_agent`, tls
tcp, interface lo; `--bare`: NIXL's UCX with only `TLS=tcp,NET_DEVICES=lo`
plus `--ucx KEY=VALUE`). NIXL bundles its own UCX, so this is a separate
question from the ucx backend's. Per run, two forked processes each make an
agent and register 64 KiB: the peer P and the victim V. P loads V's
metadata — NIXL's UCX backend makes its endpoint to V's worker right there
(`loadRemoteConnInfo`) — and progresses `--peer-steps` times
(`get_new_notifs`), so its tcp connection reaches V; P stops itself
(SIGSTOP); V progresses `--victim-before` times (it accepts P's
connection); P is SIGKILLed; then V loads P's metadata (its endpoint to P),
with `--send` posts a WRITE to P's buffer at once, and progresses for
`--victim-after` s. Without `--send` the WRITE is posted after that, to ask
NIXL whether the endpoint failed. Then V releases the request, unloads P
(its endpoint closes) and drops its agent.

A run *aborts* when V dies by a signal; it *reached* the window when V's
WRITE ended in error (NIXL's UCX error handling saw P gone); exit 4 if it
did not, 3 if V raised.

    .venv/bin/python benchmarks/nixl_tcp_abort_repro.py --runs 10 --both
    .venv/bin/python benchmarks/nixl_tcp_abort_repro.py --runs 10 --both --bare

Prints a line per run that aborted or missed the window, then
`runs N aborts A not-reached M`; exits 1 if any run aborted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

# the same pipes and stop detection
from ucx_tcp_abort_repro import _pending, _recv, _send, _stopped

BYTES = 1 << 16


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs (default 20)")
    p.add_argument("--peer-steps", type=int, default=50,
                   help="progress calls of the peer after loading the victim (default 50)")
    p.add_argument("--victim-before", type=int, default=50,
                   help="progress calls of the victim before the peer is killed (default 50)")
    p.add_argument("--victim-after", type=float, default=0.5,
                   help="seconds the victim progresses after the kill (default 0.5)")
    p.add_argument("--ucx", action="append", default=[], metavar="KEY=VALUE",
                   help="with --bare: a UCX option in NIXL's engine_config (TCP_CONN_NB=y); repeatable")
    p.add_argument("--send", action="store_true",
                   help="the victim posts its WRITE at once (queued on the new endpoint)")
    p.add_argument("--both", action="store_true",
                   help="odd runs without, even runs with --send")
    p.add_argument("--bare", action="store_true",
                   help="NIXL's UCX with TLS=tcp,NET_DEVICES=lo (and --ucx), not make_agent's")
    a = p.parse_args(argv)
    if a.runs < 1 or min(a.peer_steps, a.victim_before) < 0 or a.victim_after < 0:
        p.error("--runs must be at least 1; steps and --victim-after must not be negative")
    if a.ucx and not a.bare:
        p.error("--ucx changes NIXL's engine_config: give it with --bare (make_agent's is fixed)")
    return a


def _agent(a: argparse.Namespace, name: str):
    from pdxfer.transport.nixl import agent as nixl

    if not a.bare:  # the agent pdxfer's nixl engine makes
        return nixl.make_agent(name, "tcp", "lo")
    ag = nixl.nixl_agent(name, nixl.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    ag.create_backend("UCX", {"engine_config": ",".join(["TLS=tcp", "NET_DEVICES=lo", *a.ucx]),
                              "ucx_error_handling_mode": "peer"})
    return ag


def _side(a: argparse.Namespace, victim: bool, r: int, w: int, send: bool) -> None:
    import numpy as np

    ag = _agent(a, "V" if victim else "P")
    buf = np.zeros(BYTES, np.uint8)
    addr = buf.ctypes.data
    reg = ag.register_memory([(addr, BYTES, 0, "")], "DRAM")
    # one message each way: `_recv` keeps no bytes past the message it returns
    _send(w, addr.to_bytes(8, "little") + ag.get_agent_metadata())
    got = _recv(r)
    other_addr, other = int.from_bytes(got[:8], "little"), got[8:]

    def progress(ag, n: int) -> None:  # the agent passed in: `del ag` below drops it
        for _ in range(n):
            ag.get_new_notifs()
            time.sleep(0.001)

    if not victim:
        ag.add_remote_agent(other)  # NIXL's UCX makes its endpoint to V here
        progress(ag, a.peer_steps)
        _send(w, b"stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        return
    _recv(r)  # the peer stopped itself (after loading us and progressing)
    progress(ag, a.victim_before)
    _send(w, b"kill")
    _recv(r)  # killed
    peer = ag.add_remote_agent(other)  # our endpoint to the dead peer
    peer = peer.decode() if isinstance(peer, bytes) else peer
    state = {"xfer": None, "end": None}

    def post(ag) -> None:
        try:
            state["xfer"] = ag.initialize_xfer(
                "WRITE", ag.get_xfer_descs([(addr, BYTES, 0)], "DRAM"),
                ag.get_xfer_descs([(other_addr, BYTES, 0)], "DRAM"), peer)
            if ag.transfer(state["xfer"]) == "ERR":
                state["end"] = "ERR"
        except Exception as exc:  # NIXL raises for an endpoint it knows failed
            state["end"] = type(exc).__name__

    def check(ag) -> None:
        if state["xfer"] is not None and state["end"] is None:
            try:
                if ag.check_xfer_state(state["xfer"]) == "ERR":
                    state["end"] = "ERR"
            except Exception as exc:
                state["end"] = type(exc).__name__

    if send:
        post(ag)
    deadline = time.monotonic() + a.victim_after
    while time.monotonic() < deadline:
        ag.get_new_notifs()
        check(ag)
        time.sleep(0.001)
    if not send:
        post(ag)
        progress(ag, 10)
        check(ag)
    if state["xfer"] is not None:
        try:
            ag.release_xfer_handle(state["xfer"])
        except Exception:
            pass  # a request NIXL still holds: its agent's end releases it
    ag.remove_remote_agent(peer)  # our endpoint to P closes
    ag.deregister_memory(reg)
    del ag
    if state["end"] is None:
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
            _side(a, victim, r2, w1, send)
        except BaseException as exc:
            sys.stderr.write(f"{'victim' if victim else 'peer'} failed: {type(exc).__name__}: {exc}\n")
            code = 3
        finally:
            os._exit(code)
    os.close(w1)
    os.close(r2)
    return pid, r1, w2


def one_run(a: argparse.Namespace, send: bool) -> str | None:
    """One run; None if the victim lived and its WRITE failed by UCX, else what happened."""
    peer, p_r, p_w = _fork(a, False, send)
    vic, v_r, v_w = _fork(a, True, send)
    try:
        p_hello, v_hello = _recv(p_r), _recv(v_r)
        _send(v_w, p_hello)
        _send(p_w, v_hello)
        _send(v_w, _recv(p_r))  # "stopping"
        _stopped(peer)
        _recv(v_r)  # "kill"
        os.kill(peer, signal.SIGKILL)
        os.waitpid(peer, 0)
        _send(v_w, b"killed")
        _, status = os.waitpid(vic, 0)
        if os.WIFSIGNALED(status):
            return f"victim killed by {signal.Signals(os.WTERMSIG(status)).name}"
        if os.WEXITSTATUS(status) == 4:
            return "window not reached: the victim's WRITE did not fail"
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
    import pdxfer.transport.nixl.agent  # noqa: F401  (NIXL loaded before the forks)

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
