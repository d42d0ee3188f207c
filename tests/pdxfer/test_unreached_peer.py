"""A prefill the decode never reached is reported as not reached, never as "lost".

"prefill at X lost" sends an operator looking for the crash of a process
that may never have been started; the reason must say the handshake never
happened, and keep the connect error that says why. (A prefill that was
reached and then died is "lost": `test_engine_kill.py`.)
"""

from __future__ import annotations

import socket

import pytest
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, PeerLostError, RequestFailed


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then released: connect is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["loopback", "tcp"])
def test_a_prefill_never_reached_is_not_called_lost(backend: str) -> None:
    port = _closed_port()
    with DecodeEngine(build_pools(64, 16, seed=2), config(backend, timeout=1.0)) as decode:
        decode.expect("r0", f"127.0.0.1:{port}", {"kv": [0, 1], "state": [0]})
        with pytest.raises(RequestFailed,
                           match=rf"prefill at 127\.0\.0\.1:{port} not reached \(no handshake\): "
                                 rf"cannot connect to prefill at 127\.0\.0\.1:{port}") as exc:
            decode.wait("r0", timeout=30)
        assert " lost" not in str(exc.value)
        assert isinstance(decode.failure_cause("r0"), PeerLostError)
