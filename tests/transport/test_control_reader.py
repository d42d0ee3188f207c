"""A control reader that hits a non-transport error severs its link, loudly (#29 item 6).

The reader caught only `TransportError`: any other exception (a backend bug
in a regions or ack handler) ended its thread and left the link alive but
deaf — writes posted, acks never read, every handle waiting out its timeout.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from pdxfer.transport import TransportError
from pdxfer.transport.testing.rig import WAIT

from pdxfer import transport

BACKENDS = [b for b in ("nixl", "verbs-sim") if b in transport.available()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bug_in_the_control_reader_severs_the_link_and_is_logged_once(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    rx, tx = transport.create(backend), transport.create(backend)
    try:
        dst = rx.register(torch.zeros(1 << 16, dtype=torch.uint8))
        src = tx.register(torch.ones(1 << 16, dtype=torch.uint8))
        conn = tx.connect(rx.address())
        rows = np.array([[0, 0, 4096]], np.int64)
        conn.write(src, dst.descriptor(), rows).wait(WAIT)

        def broken(msg: object) -> None:
            raise RuntimeError("a bug in the regions handler")

        conn.regions = broken  # the reader calls it with the answer to the next Refresh
        late = rx.register(torch.zeros(1 << 16, dtype=torch.uint8))  # unknown to the link: refresh
        with caplog.at_level(logging.ERROR, logger="pdxfer.transport.control"):
            with pytest.raises(TransportError, match=r"control reader of the link to .* failed "
                                                     r"\(RuntimeError: a bug in the regions handler\)"):
                conn.write(src, late.descriptor(), rows).wait(WAIT)
            assert conn.dead
        errors = [r for r in caplog.records if "control reader" in r.getMessage()]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert tx.connect(rx.address()) is not conn  # the next connect builds a fresh link
    finally:
        tx.close()
        rx.close()
