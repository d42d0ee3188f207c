"""A ucx-all sender SIGKILLed mid-write always settles at its receiver (#35.6).

`tls="all"` cannot fence (`capabilities.fence` False), so a link of it
settles only on its sender's proof: `Bye(quiet=True)`, or its control
connection ending without any `Bye` (the process died). A receive that
fails as the sender dies used to fence the link first — closing that very
socket — so the proof arriving a moment later was never read, and
`settled()` said False for the dead sender for good: 6 of 14 kills in a
loop, and a decode's requests stayed Quarantined forever. Here 12 senders
in turn (forked by `ucx_kill_loop.py`, warm) keep writes in flight and are
SIGKILLed; each must settle (on the code before the fix the first one
failed to within a few kills: at 6 in 14, 12 kills all settling by chance is
a 0.1 % event).
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pdxfer import transport

pytestmark = pytest.mark.skipif("ucx" not in transport.available(),
                                reason="ucxx-cu12 is not installed (pip install 'pdxfer[ucx]')")

HERE = Path(__file__).resolve().parent
KILLS = 12
MIB = 4
CONNECT_TIMEOUT = 10.0
# Per sender. Its control connection's end usually arrives within ms of its death; where the
# failed receive is seen first, the wait for that end is bounded by `connect_timeout`, which a
# busy host can reach. The bug this guards kept a dead sender unsettled for good, so a bound
# above that wait loses nothing and does not fail on a loaded machine.
SETTLE = 2 * CONNECT_TIMEOUT


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the kill loop said nothing in {timeout} s (exit code {proc.poll()})"
    return proc.stdout.readline().decode().strip()


@pytest.mark.timeout(400)  # 12 warm senders, each a UCX context and 16 MiB moved, on 2 busy cores
def test_every_sigkilled_ucx_all_sender_settles_at_its_receiver() -> None:
    with transport.create("ucx", tls="all", connect_timeout=CONNECT_TIMEOUT) as rx:
        assert not rx.capabilities.fence
        dst = rx.register(torch.zeros(MIB << 20, dtype=torch.uint8))
        info = {"address": rx.address(), "descriptor": dst.descriptor()}
        proc = subprocess.Popen([sys.executable, str(HERE / "ucx_kill_loop.py"), "all", str(KILLS),
                                 str(MIB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            proc.stdin.write(msgpack.packb(info).hex().encode() + b"\n")
            proc.stdin.flush()
            for i in range(KILLS):
                line = _line(proc, 120)
                assert line.startswith("killed ") and line != "killed ?", line
                sender = line.split()[1]
                done = threading.Event()
                deadline = time.monotonic() + SETTLE
                while not rx.settled(sender) and time.monotonic() < deadline:
                    done.wait(0.02)  # polled: settled() is a question, not an event
                assert rx.settled(sender), (
                    f"SIGKILLed sender {i + 1} of {KILLS} ({sender}) has not settled {SETTLE} s "
                    "after its death: its requests would stay quarantined")
            assert _line(proc, 60) == "done"
        finally:
            proc.kill()
            proc.wait()


def test_a_send_that_finds_the_sender_hung_up_leaves_the_proof_to_the_reader() -> None:
    """The same proof lost another way: an ack or `Gone` sent to a sender that had just died.

    The send fails (connection reset) before the link's reader has read the end of the
    stream. Fenced there and then, the link closed the socket under its reader, which read
    our own cut: unproven for good (1 of 12 SIGKILLs of the test above, in one CI run).
    Here the failed send is injected while the sender still lives, then the sender's
    control connection ends without a `Bye`, as a dead process's does: the link must wait
    for its reader and settle on that end.
    """
    from pdxfer.transport.control import ControlInbound
    from pdxfer.transport.errors import PeerLostError
    from pdxfer.transport.testing.rig import WAIT, until

    with transport.create("ucx", tls="all") as rx, transport.create("ucx", tls="all") as tx:
        dst = rx.register(torch.zeros(1 << 16, dtype=torch.uint8))
        src = tx.register(torch.ones(1 << 16, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        conn.write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(WAIT)
        [link] = rx.inbound.of(tx.engine_id)
        assert isinstance(link, ControlInbound) and not link.self_settles

        def reset(*_args: object) -> None:
            raise PeerLostError("sending Gone failed: [Errno 104]") from ConnectionResetError(104, "reset")

        link._send = reset
        link.region_gone(12345)  # a Gone: its send fails as a dead sender's would
        assert not link.dead, "fenced before its reader read the sender's end"
        conn.sock.shutdown(socket.SHUT_RDWR)  # the sender's side ends without a Bye: it died
        assert until(lambda: rx.settled(tx.engine_id), WAIT), "the dead sender never settled"
