"""A UCX worker address from the wire never crashes the process that reads it (#35.5).

UCX parses a worker address from a pointer without its length, so a
truncated or corrupted address used to be read past its end: a segfault of
the receiving engine within tens of corrupted Hellos, and of a sender given
a corrupted Welcome. Every attack here runs against an engine in a child
process — a crash is a dead child and a failed test, never a dead pytest:

* Hello and Welcome addresses with a byte changed, cut short or extended
  after the sender computed its checksum (what corruption in transit or a
  careless forger sends): each refused by name (`worker_sum`), before UCX
  sees it, over 100 tries per kind, and the engine still serves;
* addresses cut short with a checksum recomputed over what is left (a
  forger who knows the wire): these reach UCX's parser, over the zero
  padding `lib.endpoint` adds; the engine survives them all and refuses
  each one it cannot connect to. (A survival check, not a regression test:
  with the padding removed it still passed its 100 tries here; in a bare
  loop, truncations shorter than `MIN_ADDRESS` included, UCX crashed within
  27–85.)
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pdxfer import transport

pytestmark = pytest.mark.skipif("ucx" not in transport.available(),
                                reason="ucxx-cu12 is not installed (pip install 'pdxfer[ucx]')")

ROOT = Path(__file__).resolve().parents[2]
WAIT = 30.0
TRIES = 100  # per kind of corruption


def _corrupt(address: bytes, kind: str, rng: random.Random) -> bytes:
    b = bytearray(address)
    if kind == "flipped":
        pos = rng.randrange(len(b))
        b[pos] ^= rng.randrange(1, 256)  # never a no-op
    elif kind == "truncated":
        b = b[:rng.randrange(1, len(b))]
    elif kind == "extended":
        b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    return bytes(b)


def _real_address() -> bytes:
    from pdxfer.transport.ucx import lib

    ctx = lib.context("tcp", "lo")
    return lib.worker_address(lib.worker(ctx))


def _hello_reply(host: str, port: int, hello) -> object:
    from pdxfer.transport.ucx import wire

    with socket.create_connection((host, port), timeout=WAIT) as sock:
        sock.settimeout(WAIT)
        wire.CONTROL.send(sock, hello)
        return wire.CONTROL.recv(sock)


@pytest.fixture(scope="module")
def peer():
    """One engine process for both Hello attacks (its start-up is most of their cost)."""
    from pdxfer.transport.testing.rig import Backend, PeerProcess

    proc = PeerProcess(Backend.named("ucx"), 1 << 20)
    try:
        yield proc
    finally:
        proc.kill()


def _still_serves(peer) -> None:
    assert peer.child.poll() is None, f"the engine process died (exit code {peer.child.poll()})"
    with transport.create("ucx") as tx:
        src = tx.register(torch.ones(4096, dtype=torch.uint8))
        tx.connect(peer.address).write(src, peer.descriptor,
                                       np.array([[0, 0, 4096]], np.int64)).wait(WAIT)


def test_a_hello_whose_worker_address_was_corrupted_is_refused_by_name_and_the_engine_lives(peer) -> None:
    from pdxfer.transport.ucx import lib, wire
    from pdxfer.transport.wire import ErrorMessage

    address = _real_address()
    rng = random.Random(35_5)
    host, port = peer.address["host"], peer.address["port"]
    for kind in ("flipped", "truncated", "extended"):
        for i in range(TRIES):
            bad = _corrupt(address, kind, rng)
            # the checksum the honest sender computed, over the bytes before the damage
            reply = _hello_reply(host, port, wire.Hello("hostile", bad, lib.address_sum(address)))
            assert isinstance(reply, ErrorMessage), (kind, i, reply)
            assert "worker_sum" in reply.reason or ("outside" in reply.reason and "field worker"
                                                    in reply.reason), (kind, i, reply.reason)
            assert peer.child.poll() is None, f"the engine died on {kind} address {i}: {bad.hex()}"
    _still_serves(peer)


def test_a_hello_with_a_forged_checksum_over_a_truncated_address_never_crashes_the_engine(peer) -> None:
    # What passes the checksum reaches UCX's parser: cut short, it must read only our zero padding
    # (without it, a truncated address segfaulted a process within 27-85 tries here)
    from pdxfer.transport.ucx import lib, wire
    from pdxfer.transport.wire import ErrorMessage

    address = _real_address()
    rng = random.Random(35_51)
    host, port = peer.address["host"], peer.address["port"]
    reasons: set[str] = set()
    for i in range(TRIES):
        bad = address[:rng.randrange(lib.MIN_ADDRESS, len(address))]
        reply = _hello_reply(host, port, wire.Hello("forger", bad, lib.address_sum(bad)))
        assert peer.child.poll() is None, f"the engine died on truncated address {i}: {bad.hex()}"
        if isinstance(reply, ErrorMessage):
            reasons.add(reply.reason.split(":")[0])
    assert reasons, "not one truncated address was refused: the attack did not reach UCX"
    _still_serves(peer)


# -- a corrupted Welcome, to a sender in a child process --------------------------------------------

DIALER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from pdxfer import transport
    port, tries = int(sys.argv[2]), int(sys.argv[3])
    refused = 0
    with transport.create("ucx", connect_timeout=10.0) as tx:
        for i in range(tries):
            try:
                tx.connect({"backend": "ucx", "engine": "fake-%d" % i, "host": "127.0.0.1",
                            "port": port})
            except transport.ProtocolError as exc:
                if "worker_sum" in str(exc) or "field worker" in str(exc):
                    refused += 1
                else:
                    print("other", exc, flush=True)
            else:
                print("accepted", i, flush=True)
    print("refused", refused, flush=True)
""")


def test_a_welcome_whose_worker_address_was_corrupted_fails_the_connect_by_name_and_the_sender_lives() -> None:
    from pdxfer.transport.ucx import lib, wire

    address = _real_address()
    rng = random.Random(35_52)
    kinds = ["flipped", "truncated", "extended"]
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    served: list[str] = []

    def serve() -> None:
        for i in range(TRIES * len(kinds)):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(WAIT)
                hello = wire.CONTROL.recv(conn)
                assert isinstance(hello, wire.Hello)
                kind = kinds[i // TRIES]
                bad = _corrupt(address, kind, rng)
                wire.CONTROL.send(conn, wire.Welcome(f"fake-{i}", bad, lib.address_sum(address),
                                                     b"", f"fake-{i}#1"))
                served.append(kind)
                try:
                    conn.recv(1)  # until the dialer hangs up
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out = subprocess.run([sys.executable, "-c", DIALER, str(ROOT), str(port),
                              str(TRIES * len(kinds))],
                             capture_output=True, text=True, timeout=240)
    finally:
        server.close()
        thread.join(WAIT)
    assert out.returncode == 0, f"the sender died (exit code {out.returncode}): {out.stderr[-2000:]}"
    assert out.stdout.strip().splitlines()[-1] == f"refused {TRIES * len(kinds)}", out.stdout[-2000:]
    assert served == [k for k in kinds for _ in range(TRIES)]
