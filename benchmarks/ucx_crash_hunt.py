"""Hunt the ucx backend's segfaults at teardown: create → transfer → kill the peer → close, many times.

Each run is two short processes forked from this one (which has imported
torch and UCXX but made no UCX context, so a fork costs milliseconds, not the
seconds of a fresh interpreter — on a loaded 2-core machine that is the
difference between 10 runs and 200): a peer P and a victim V, each with its
own ucx engine. V writes to P and P writes to V, several writes of `--mib`
MiB in flight both ways; the hunt SIGKILLs P after a random delay (before,
during or after the bytes moved), V waits until it sees the peer gone (or a
short bound) and closes its engine — which closes its endpoint to the dead
peer (`UcxLink._close`) and retires the dead peer's inbound worker — and
exits; in half the runs V closes within `--close-within` s of the kill
instead, while UCX may not know yet. A run *crashes* when V dies by a signal (SIGSEGV, SIGABRT) or does not
exit within `--run-timeout`. Prints one line per crash, then
`runs N crashes C (rate %)`; exits 1 if any crashed.

    .venv/bin/python benchmarks/ucx_crash_hunt.py --runs 120 --time 900

`--repo PATH` hunts in another checkout (its packages are imported instead
of this one's), which is how the figure for older code is taken. `--cores DIR`
lets each victim dump core into `DIR/victim-PID/` (the kernel's `core_pattern`
must be a relative name, the default `core`): a crash's line names the file,
and `gdb -batch -ex bt PYTHON CORE` gives the native stack that the Python
stack `faulthandler` prints cannot (how the UCX frames in docs/reliability.md
were found). Clean runs' directories are removed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=120, help="runs at most (default 120)")
    p.add_argument("--time", type=float, default=900.0, help="stop starting runs after this many s")
    p.add_argument("--mib", type=int, default=4, help="MiB per write (default 4)")
    p.add_argument("--writes", type=int, default=4, help="writes in flight each way (default 4)")
    p.add_argument("--run-timeout", type=float, default=60.0, help="a run that takes longer hangs")
    p.add_argument("--close-within", type=float, default=0.02,
                   help="a quick close comes this many s after the kill at most (default 0.02)")
    p.add_argument("--tls", default="tcp", choices=("tcp", "all"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", type=Path, default=None,
                   help="victims dump core into DIR/victim-PID/ (default: no core files)")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the checkout whose pdxfer is hunted")
    a = p.parse_args(argv)
    a.repo = a.repo.resolve()  # a victim with --cores runs in another directory
    if a.runs < 1 or a.time <= 0 or a.mib < 1 or a.writes < 1 or a.run_timeout <= 0:
        p.error("--runs, --time, --mib, --writes and --run-timeout must be positive")
    return a


def _send(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _recv(fd: int, timeout: float) -> str:
    import select

    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no answer")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError("closed")
        buf += chunk
    return buf.decode().strip()


def _engine_side(a: argparse.Namespace, out_fd: int, in_fd: int, victim: bool) -> int:
    """One side of a run, in a forked child: an engine that writes to the other side."""
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack: where
    import msgpack
    import numpy as np
    import torch

    from pdxfer import transport

    nbytes = a.mib << 20
    engine = transport.create("ucx", tls=a.tls, connect_timeout=5.0)
    src = engine.register(torch.full((nbytes,), 0xAB, dtype=torch.uint8))
    dst = engine.register(torch.zeros(nbytes * a.writes, dtype=torch.uint8))
    _send(out_fd, msgpack.packb({"address": engine.address(),
                                 "descriptor": dst.descriptor()}).hex())
    other = msgpack.unpackb(bytes.fromhex(_recv(in_fd, a.run_timeout)))
    conn = engine.connect(other["address"])
    handles = [conn.write(src, other["descriptor"],
                          np.array([[0, i * nbytes, nbytes]], np.int64), notify=b"n")
               for i in range(a.writes)]
    _send(out_fd, "writing")
    if not victim:
        _recv(in_fd, a.run_timeout * 10)  # killed meanwhile
        return 0
    close_after = float(_recv(in_fd, a.run_timeout))  # the peer was killed this instant
    if close_after < 0:  # wait until UCX and the control link saw it gone, then close
        for h in handles:
            try:
                h.wait(5.0)
            except transport.TransportError:
                pass
        deadline = time.monotonic() + 5.0
        while engine.has_peer(other["address"]["engine"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    else:  # close while UCX may be finding out: the window the crashes were seen in
        time.sleep(close_after)
    engine.close()
    return 0


def _fork_side(a: argparse.Namespace, victim: bool) -> tuple[int, int, int]:
    """(pid, read fd from it, write fd to it) of a forked engine side."""
    r_out, w_out = os.pipe()
    r_in, w_in = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r_out)
            os.close(w_in)
            if victim and a.cores is not None:
                _core_here(a.cores)
            code = _engine_side(a, w_out, r_in, victim)
        except BaseException as exc:  # a failure of the run, not a crash: say it and exit
            try:
                sys.stderr.write(f"side failed: {type(exc).__name__}: {exc}\n")
            except Exception:
                pass
            code = 3
        finally:
            os._exit(code)
    os.close(w_out)
    os.close(r_in)
    return pid, r_out, w_in


def _core_here(cores: Path) -> None:
    """Let this process dump core, into a directory of its own under `cores`."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    where = cores / f"victim-{os.getpid()}"
    where.mkdir(parents=True, exist_ok=True)
    os.chdir(where)


def _core_of(a: argparse.Namespace, pid: int, crashed: bool) -> str:
    """`, core PATH` for a crashed victim that left one; a clean run's directory is removed."""
    if a.cores is None:
        return ""
    where = a.cores / f"victim-{pid}"
    cores = sorted(where.glob("core*")) if where.is_dir() else []
    if not crashed and not cores and where.is_dir():
        where.rmdir()
    return f", core {cores[0]}" if crashed and cores else ""


def _wait(pid: int, timeout: float) -> int | None:
    """The wait status of `pid`, or None if it did not end within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def one_run(a: argparse.Namespace, rng: random.Random) -> str | None:
    """One run; None if the victim closed and exited cleanly, else what went wrong."""
    peer, p_r, p_w = _fork_side(a, victim=False)
    victim, v_r, v_w = _fork_side(a, victim=True)
    fds = (p_r, p_w, v_r, v_w)
    try:
        try:
            p_addr = _recv(p_r, a.run_timeout)
            v_addr = _recv(v_r, a.run_timeout)
            _send(v_w, p_addr)
            _send(p_w, v_addr)
            _recv(p_r, a.run_timeout)  # the peer's writes are posted
            _recv(v_r, a.run_timeout)
        except (TimeoutError, EOFError) as exc:
            os.kill(peer, signal.SIGKILL)
            status = _wait(victim, a.run_timeout)
            if status is not None and os.WIFSIGNALED(status):
                return f"victim killed by signal {os.WTERMSIG(status)} during set-up"
            if status is None:
                os.kill(victim, signal.SIGKILL)
            return f"set-up failed ({exc}); not counted as a crash" if status is not None else "set-up hung"
        time.sleep(rng.uniform(0.0, 0.05))  # before, during or after the bytes moved
        os.kill(peer, signal.SIGKILL)
        # half the runs close at once or within a few ms (UCX may not know yet), half after
        # the death was seen
        close_after = rng.uniform(0.0, a.close_within) if rng.random() < 0.5 else -1.0
        _send(v_w, repr(close_after))
        status = _wait(victim, a.run_timeout)
        if status is None:
            os.kill(victim, signal.SIGKILL)
            _wait(victim, 5.0)
            return f"victim hung past {a.run_timeout} s"
        if os.WIFSIGNALED(status):
            return (f"victim killed by signal {os.WTERMSIG(status)} "
                    f"({signal.Signals(os.WTERMSIG(status)).name}){_core_of(a, victim, True)}")
        _core_of(a, victim, False)
        if os.WEXITSTATUS(status) != 0:
            return f"set-up failed (victim exit {os.WEXITSTATUS(status)}); not counted as a crash"
        return None
    finally:
        _wait(peer, 5.0)
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Run the hunt; 0 if no run crashed."""
    a = _args(argv)
    sys.path.insert(0, str(a.repo))
    import torch  # noqa: F401  (imported before the forks: each side starts warm)

    from pdxfer import transport

    # `transport/` installs as `pdxfer.transport` (setup.py): an editable install's finder
    # maps that name to its own checkout whatever sys.path says, so with --repo the other
    # checkout's `pdxfer/` could run over this checkout's `transport/` — the ucx code hunted.
    for module in (transport, sys.modules["pdxfer"]):
        if not Path(module.__file__).resolve().is_relative_to(a.repo):
            print(f"{module.__name__} was imported from {module.__file__}, not from --repo "
                  f"{a.repo}: run with that checkout's own venv, or link its folders in "
                  f"(ln -s ../transport {a.repo}/pdxfer/transport; the same for layout)",
                  file=sys.stderr)
            return 2
    if "ucx" not in transport.available():
        print("ucx is not available (pip install 'pdxfer[ucx]')", file=sys.stderr)
        return 2
    import pdxfer.transport.ucx  # noqa: F401  (UCXX loaded, no context made)

    rng = random.Random(a.seed)
    runs = crashes = skipped = 0
    start = time.monotonic()
    while runs < a.runs and time.monotonic() - start < a.time:
        what = one_run(a, rng)
        if what is not None and "not counted" in what:
            skipped += 1
            print(f"run {runs + skipped}: {what}", flush=True)
            continue
        runs += 1
        if what is not None:
            crashes += 1
            print(f"run {runs}: CRASH: {what}", flush=True)
    rate = 100.0 * crashes / runs if runs else 0.0
    print(f"runs {runs} crashes {crashes} ({rate:.1f} %) set-up failures {skipped} "
          f"in {time.monotonic() - start:.0f} s (tls={a.tls}, {a.writes}x{a.mib} MiB each way, "
          f"repo {a.repo})", flush=True)
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
