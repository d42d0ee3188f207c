"""#25 item 4: a decode whose data listener trickles its welcome cannot hold the prefill's dial.

A raw control link completes a real Hello (a decode engine's identity and
pools) whose transport address points at a fake listener: it accepts the
prefill's data dial, reads its hello, announces a welcome and then sends it
a byte at a time. Before the kit, the dial waited per `recv`, so such a peer
held the prefill's dial thread forever despite `connect_timeout`, and
`PrefillEngine.close()` returned with that thread still blocked in `recv`.
Now the transport bounds the whole dial by one deadline, and its `close()`
shuts the socket under a dial in progress (`transport/dial.py`; that half is
the kit's `test_close_ends_a_dial_in_progress`, on every listening backend).
The engine closes its transport before it joins its dial workers, so its
`close()` returns at once rather than after the dial's `connect_timeout`.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from pdxfer.transport.testing.rig import Trickler
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, PrefillEngine, transport
from pdxfer.protocol import CONTROL, Hello

WAIT = 20.0


def _hello_pointing_at(prefill: PrefillEngine, mute: DecodeEngine, backend: str, port: int) -> socket.socket:
    host, bport = prefill.bootstrap_address.rsplit(":", 1)
    raw = socket.create_connection((host.strip("[]"), int(bport)), timeout=WAIT)
    address = {**mute._transport.address(), "host": "127.0.0.1", "port": port}
    raw.sendall(CONTROL.pack(Hello(mute.engine_id, backend, address, **mute._pools.hello_fields())))
    return raw


def _listening(backend: str) -> None:
    if not transport.capabilities(backend).listens:
        pytest.skip(f"capability listens=False ({backend}): its engines are not dialed")


def test_a_trickled_welcome_cannot_hold_the_prefills_dial_past_connect_timeout(backend) -> None:
    _listening(backend)
    fake = Trickler(every=0.2)
    cfg = config(backend, timeout=30.0, connect_timeout=1.0)
    before = set(threading.enumerate())
    try:
        with PrefillEngine(build_pools(64, 16), cfg) as prefill, \
                DecodeEngine(build_pools(64, 16), cfg) as mute:
            raw = _hello_pointing_at(prefill, mute, backend, fake.port)
            try:
                assert fake.accepted.wait(WAIT), "the prefill never dialed the decode's data address"
                dials = [t for t in set(threading.enumerate()) - before if t.name.startswith("pdxfer-dial")]
                t0 = time.monotonic()
                assert fake.hung_up.wait(WAIT), "the trickled welcome held the dial past connect_timeout"
                assert time.monotonic() - t0 < 1.0 + 4.0
            finally:
                raw.close()
        # PrefillEngine.close() returned: no dial of it is still blocked in recv
        for t in dials:
            t.join(5.0)
        assert not [t.name for t in dials if t.is_alive()], "a dial thread outlived close()"
    finally:
        fake.close()


def test_close_ends_a_dial_in_progress_without_waiting_out_connect_timeout(backend) -> None:
    # close() shuts the transport (and the socket under the dial) before it joins its dial
    # workers; joining first would wait out the dial's whole connect_timeout.
    _listening(backend)
    fake = Trickler(every=0.2, silent=True)
    cfg = config(backend, timeout=30.0, connect_timeout=30.0)
    before = set(threading.enumerate())
    try:
        prefill = PrefillEngine(build_pools(64, 16), cfg)
        with DecodeEngine(build_pools(64, 16), cfg) as mute:
            raw = _hello_pointing_at(prefill, mute, backend, fake.port)
            try:
                assert fake.accepted.wait(WAIT), "the prefill never dialed the decode's data address"
                dials = [t for t in set(threading.enumerate()) - before if t.name.startswith("pdxfer-dial")]
                assert dials, "no dial thread found"
                t0 = time.monotonic()
                prefill.close()
                took = time.monotonic() - t0
            finally:
                raw.close()
        assert took < 10.0, f"close() took {took:.1f} s with a dial held (connect_timeout 30 s)"
        assert not [t.name for t in dials if t.is_alive()], "a dial thread outlived close()"
        assert fake.hung_up.wait(WAIT)
    finally:
        fake.close()
