"""A region deregistered while a sender's control link is mid-handshake (#19's kit, control.py).

The receiver identifies a link before it sends the `Welcome`, so a
deregistration in that window reaches the link and says `Gone`. The sender's
dial reads exactly one frame, the Welcome: a `Gone` ahead of it failed the
dial ("unexpected frame"). `ControlInbound` now holds such a `Gone` and sends
it right after the Welcome. Every backend with control links (nixl, verbs,
ucx) goes through the one kit path; each is run here with the window held
open by a gate at the end of its `admit`.
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest
import torch
from pdxfer.transport import control
from pdxfer.transport.errors import RegistrationError

from pdxfer import transport

WAIT = 20.0

INBOUND = {
    "verbs-sim": "pdxfer.transport.verbs.inbound:InboundPeer",
    "nixl": "pdxfer.transport.nixl.inbound:InboundPeer",
    "ucx": "pdxfer.transport.ucx.inbound:UcxInbound",
}


@pytest.mark.parametrize("backend", sorted(INBOUND))
def test_a_region_deregistered_during_a_handshake_leaves_the_dial_whole(backend, monkeypatch) -> None:
    if backend not in transport.available():
        pytest.skip(f"{backend} is not available here")
    module, name = INBOUND[backend].split(":")
    cls = getattr(importlib.import_module(module), name)
    real_admit, real_send = cls.admit, control.ControlInbound.send
    admitted, release, gone_said = threading.Event(), threading.Event(), threading.Event()

    def admit(self, hello):  # identified, Welcome built, not sent: the window
        welcome = real_admit(self, hello)
        admitted.set()
        release.wait(WAIT)
        return welcome

    def send(self, msg):
        real_send(self, msg)
        if isinstance(msg, control.Gone):
            gone_said.set()

    monkeypatch.setattr(cls, "admit", admit)
    monkeypatch.setattr(control.ControlInbound, "send", send)
    rx, tx = transport.create(backend), transport.create(backend)
    try:
        gone = rx.register(torch.zeros(4096, dtype=torch.uint8))
        kept_buf = torch.zeros(4096, dtype=torch.uint8)
        kept = rx.register(kept_buf)
        src = tx.register(torch.full((4096,), 7, dtype=torch.uint8))
        result: dict = {}

        def dial() -> None:
            try:
                result["conn"] = tx.connect(rx.address())
            except Exception as exc:  # noqa: BLE001 — the test reports it
                result["error"] = exc

        dialing = threading.Thread(target=dial)
        dialing.start()
        assert admitted.wait(WAIT), "the receiver never admitted the link"
        deregistering = threading.Thread(target=rx.deregister, args=(gone,))
        deregistering.start()
        assert gone_said.wait(WAIT), "the deregistration never reached the link"
        release.set()
        dialing.join(WAIT)
        deregistering.join(WAIT)
        assert "error" not in result, f"the dial failed: {result.get('error')!r}"
        conn = result["conn"]
        table = np.array([[0, 0, 4096]], np.int64)
        conn.write(src, kept.descriptor(), table).wait(WAIT)
        assert bool((kept_buf == 7).all())
        with pytest.raises(RegistrationError):
            conn.write(src, gone.descriptor(), table).wait(WAIT)
    finally:
        release.set()
        tx.close()
        rx.close()
